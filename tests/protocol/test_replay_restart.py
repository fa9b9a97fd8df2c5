"""Replay protection that survives a coordinator restart (issue 17, item 3): the replay guard is
persisted in the coordinator's store, and Join/Leave are honoured only when signed later than the
member's last honoured one, so a third party re-publishing a member's old Leave (or re-sending its
old Join) after a restart changes nothing."""

from __future__ import annotations

import asyncio
import time

import pytest
from protocol_testnet import make_spec, publish_until, run, start_coordinator

from protocol.coordinator import Coordinator
from protocol.envelope import open_envelope, seal
from protocol.errors import ReplayedMessage
from protocol.identity import NodeKey
from protocol.messages import Join, LeaseBatchRequest, LeaseGrants, Leave, Refusal, RunSpec
from protocol.transport import PeerHost

CK = NodeKey.from_seed(b"c" * 32)
M = NodeKey.from_seed(b"m" * 32)


def test_join_and_leave_must_be_newer_than_the_last_honoured_one_also_after_a_restart(tmp_path):
    spec = RunSpec(run_id="r", coordinator=CK.peer_id)
    c = Coordinator(tmp_path, spec, now=0)
    join = Join(spec_hash=c.spec_hash, role="inference")
    c.join(M.peer_id, join, 1, stamp_ms=2000)
    with pytest.raises(ReplayedMessage):
        c.leave(M.peer_id, 2, stamp_ms=1000)  # a goodbye from before this join
    assert M.peer_id in c.view.members
    c.leave(M.peer_id, 3, stamp_ms=3000)
    with pytest.raises(ReplayedMessage):
        c.join(M.peer_id, join, 4, stamp_ms=2000)  # the old join again
    c.join(M.peer_id, join, 5, stamp_ms=4000)
    c.close()
    c = Coordinator(tmp_path, spec, now=10)  # restarted: the stamps are on disk
    with pytest.raises(ReplayedMessage):
        c.leave(M.peer_id, 11, stamp_ms=3000)
    assert M.peer_id in c.view.members
    c.leave(M.peer_id, 12, stamp_ms=5000)  # a fresh goodbye still works
    assert M.peer_id not in c.view.members
    c.close()


def test_a_replayed_leave_over_gossip_and_a_replayed_join_are_refused_after_a_restart(tmp_path):
    async def body():
        spec = make_spec(CK, run_id="replay", heartbeat_interval_s=5.0)
        coord = await start_coordinator(tmp_path, CK, spec)
        member, third = PeerHost(M), PeerHost(NodeKey.generate())
        await member.start()
        await third.start()
        try:
            async def join_raw(c, envelope: bytes):
                await member.connect(c.host.addrs[0])
                return open_envelope(await member.request(CK.peer_id, c.net.rpc_protocol, envelope, timeout=10),
                                     spec.run_id).message

            join1 = seal(M, spec.run_id, Join(spec_hash=spec.spec_hash(), role="inference"))
            assert not isinstance(await join_raw(coord, join1), Refusal)
            await next_ms()  # a later signing time than the join's (stamps compare in ms)
            leave1 = seal(M, spec.run_id, Leave(reason="bye"))  # what a third party captures
            await coord._on_gossip(coord.net.open(leave1))
            assert M.peer_id not in coord.state.view.members
            await next_ms()  # the same, for the second join
            assert not isinstance(await join_raw(coord, seal(M, spec.run_id, Join(spec_hash=spec.spec_hash(),
                                                                                   role="inference"))), Refusal)
            lease_req = seal(M, spec.run_id, LeaseBatchRequest(policy_version=0, count=1))
            assert isinstance(await join_raw(coord, lease_req), LeaseGrants)
            # restart on the same state directory
            await coord.stop()
            await coord.host.stop()
            coord.state.close()
            coord = await start_coordinator(tmp_path, CK, spec)
            assert M.peer_id in coord.state.view.members
            # the third party re-publishes the captured Leave on the run's topic
            await third.connect(coord.host.addrs[0])
            await third.subscribe(coord.net.topic)
            await publish_until(third, coord.net.topic, leave1, lambda: coord.net.refused.get("ReplayedMessage", 0) >= 1,
                                "the replay refused")
            assert M.peer_id in coord.state.view.members
            # any request captured before the restart: the persisted guard refuses it
            reply = await join_raw(coord, lease_req)
            assert isinstance(reply, Refusal) and reply.reason == "ReplayedMessage"
            # the old Join, sent again by its own signer: refused too (persisted guard and stamp)
            reply = await join_raw(coord, join1)
            assert isinstance(reply, Refusal) and reply.reason == "ReplayedMessage"
            # the guard alone would forget it after its horizon; the stamp rule does not
            coord.net.guard._seen.clear()
            with pytest.raises(ReplayedMessage):
                coord.state.leave(M.peer_id, time.time(), stamp_ms=open_envelope(leave1, spec.run_id).timestamp_ms)
        finally:
            await coord.stop()
            await coord.host.stop()
            await member.stop()
            await third.stop()
    run(body())


async def next_ms() -> None:
    """Return once the wall clock's millisecond (the envelopes' signing stamp) has moved on."""
    start = time.time_ns() // 1_000_000
    while time.time_ns() // 1_000_000 == start:
        await asyncio.sleep(0)
