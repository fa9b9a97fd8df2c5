"""A member whose requests reach the coordinator is alive even when its heartbeats do not (the
docs/node.md walk-through: after a coordinator restart one inference node's gossip did not reach it
for 13 s while its submissions did; it was ejected as dead and its 7 leased units were refused)."""

from __future__ import annotations

import asyncio

from protocol_testnet import make_spec, run, start_coordinator, start_member, stop_all

from protocol.client import ONCE, CoordinatorClient
from protocol.identity import NodeKey


def test_a_member_that_keeps_asking_is_not_ejected_when_its_heartbeats_stop(tmp_path):
    async def body():
        ck = NodeKey.generate()
        spec = make_spec(ck, heartbeat_interval_s=0.3, dead_after_missed=3)
        coord = await start_coordinator(tmp_path, ck, spec, policy_version=0)
        boot = coord.host.addrs[0]
        asking, silent = await start_member(spec, boot), await start_member(spec, boot)
        try:
            for m in (asking, silent):  # heartbeats stop (their gossip lost), the hosts stay up
                m._beating.cancel()
            client = CoordinatorClient(asking, boot, retry=ONCE)
            for _ in range(12):  # 3.6 s: over three times the 0.9 s after which silence is death
                await client.lease(1)
                await asyncio.sleep(0.3)
            now = __import__("time").time()
            assert coord.state.view.state(asking.key.peer_id, now) != "dead"
            assert silent.key.peer_id not in coord.state.view.members  # no word at all: ejected
        finally:
            await stop_all(coord, [asking, silent])
    run(body())
