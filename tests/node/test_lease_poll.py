"""An inference node whose lease call found no work asks again as soon as a newer version is queued for its
engine, not at its next poll: at k = 1 the next batch's leases go only to a node holding the newest version,
so each poll's wait was weight latency (node/roles/inference.py, `_held_newer`)."""

from __future__ import annotations

import asyncio

from node.roles.inference import InferenceNode
from protocol.identity import NodeKey
from protocol.messages import RunSpec


class NoRoomYet:
    """NAMED STAND-IN for the coordinator's client: answers every lease call with no work (the coordinator's
    answer to a node that does not yet hold the version the open batch needs) and records what each call said
    the node holds. The real client and coordinator are covered by tests/protocol/test_client.py."""

    def __init__(self):
        self.calls: list[int | None] = []
        self.asked = asyncio.Event()

    async def lease(self, count: int, holds_version: int | None = None) -> list:
        self.calls.append(holds_version)
        self.asked.set()
        return []


def test_a_node_polling_for_work_asks_again_at_once_when_a_newer_version_is_queued(tmp_path, monkeypatch):
    spec = RunSpec(run_id="poll", coordinator="c", environment="reverse", group_size=2, recipe={"hidden": 64})
    node = InferenceNode(NodeKey.generate(), spec, "", tmp_path)
    monkeypatch.setattr(InferenceNode, "LEASE_POLL_S", 60.0)  # a poll would outlast the test's limits
    client = NoRoomYet()

    async def body() -> None:
        node._newest_loaded, node._in_flight = 0, 0
        loop = asyncio.create_task(node._lease_more(client))
        await asyncio.wait_for(client.asked.wait(), 10)  # the loop ran on from its call into its poll
        assert not loop.done()  # no work, no newer version: it waits
        node._queued(1)  # what `_load` does once the engine has version 1 queued
        await asyncio.wait_for(loop, 10)  # back at once, far inside the 60 s poll
        client.asked.clear()
        again = asyncio.create_task(node._lease_more(client))
        await asyncio.wait_for(client.asked.wait(), 10)
        assert client.calls == [0, 1]  # the next call says the node holds version 1
        again.cancel()

    asyncio.run(body())


def test_a_node_fetching_a_newer_version_asks_once_it_is_queued_not_once_the_fetch_task_ends(tmp_path, monkeypatch):
    """The fetching task goes on after queueing the version (the store's retention deletes old payloads); a lease
    loop waiting on the task asked that much later (the 5.2B node on the H200 host: 0.68-0.90 s, session 35)."""
    spec = RunSpec(run_id="poll", coordinator="c", environment="reverse", group_size=2, recipe={"hidden": 64})
    node = InferenceNode(NodeKey.generate(), spec, "", tmp_path)
    monkeypatch.setattr(InferenceNode, "FETCH_WAIT_S", 60.0)  # waiting out the fetch would outlast the test's limits
    client = NoRoomYet()

    async def body() -> None:
        node._newest_loaded, node._in_flight = 0, 0
        node.hashes = {0: "h0", 1: "h1"}  # version 1 announced, not yet loaded
        retention = asyncio.Event()  # the fetching task's tail: held until the test lets it go
        node._fetching = asyncio.create_task(retention.wait())
        loop = asyncio.create_task(node._lease_more(client))
        await asyncio.wait_for(client.asked.wait(), 10)
        assert not loop.done()  # no work, the newer version still on its way: it waits
        node._queued(1)  # queued for the engine; the fetching task is still deleting old payloads
        await asyncio.wait_for(loop, 10)  # back at once, not at the task's end
        assert not node._fetching.done()
        client.asked.clear()
        again = asyncio.create_task(node._lease_more(client))
        await asyncio.wait_for(client.asked.wait(), 10)
        assert client.calls == [0, 1]
        again.cancel()
        retention.set()
        await node._fetching

    asyncio.run(body())
