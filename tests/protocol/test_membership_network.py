"""Membership and leases over real libp2p hosts on 127.0.0.1, in one process."""

from __future__ import annotations

import asyncio
import time

from protocol_testnet import (WAIT_S, eventually, lease_one, make_spec, mesh_formed, run, start_coordinator,
                              start_member, stop_all)

from protocol.identity import NodeKey
from protocol.errors import LeaseExpired, NotMember


def test_join_heartbeat_leave_and_death_regrants_the_dead_members_lease(tmp_path):
    async def body():
        ck = NodeKey.generate()
        spec = make_spec(ck, batch_groups=16)
        coord = await start_coordinator(tmp_path, ck, spec, policy_version=0)
        boot = coord.host.addrs[0]
        members = [await start_member(spec, boot) for _ in range(3)]
        try:
            ids = {m.key.peer_id for m in members}
            # Every member's view converges on the others through gossip heartbeats alone.
            await eventually(lambda: all(ids - {m.key.peer_id} <= m.alive_peers() for m in members), WAIT_S, "views converge")
            await eventually(lambda: ids <= set(coord.state.view.members), WAIT_S, "coordinator sees all")

            grant_dying = await lease_one(members[0])
            grant_leaving = await lease_one(members[1])
            # Graceful leave: the lease is back in the pool at once and the others drop the member.
            await members[1].leave()
            await eventually(lambda: members[1].key.peer_id not in coord.state.view.members, WAIT_S, "leave seen")
            await eventually(lambda: members[1].key.peer_id not in members[2].alive_peers(), WAIT_S, "leave gossiped")
            regrant = await lease_one(members[2])
            assert regrant.work_id == grant_leaving.work_id and regrant.task_index == grant_leaving.task_index

            # Death: member 0 stops beating; after 3 missed beats it is ejected and its work re-granted.
            t0 = time.monotonic()
            await members[0].crash()
            await eventually(lambda: members[0].key.peer_id not in coord.state.view.members, WAIT_S, "death detected")
            detected = time.monotonic() - t0
            assert detected >= spec.heartbeat_interval_s * 2, detected  # not before beats were really missed
            await eventually(lambda: members[0].key.peer_id not in members[2].alive_peers(), WAIT_S, "death in peer view")
            again = await lease_one(members[2])
            assert again.work_id == grant_dying.work_id and again.task_index == grant_dying.task_index
            # The dead member may not take new work until it joins again.
            try:
                await lease_one(members[0])
                raise AssertionError("an ejected member got a lease")
            except NotMember:
                pass
            # Member 2 keeps its place throughout (honest beats keep it alive).
            assert members[2].key.peer_id in coord.state.view.members
        finally:
            await stop_all(coord, members)
    run(body())


def test_gossip_reaches_every_peer_of_eight(tmp_path):
    async def body():
        ck = NodeKey.generate()
        # no liveness test: a loaded machine's slow beats must not eject (and so un-hear) a member mid-wait
        spec = make_spec(ck, heartbeat_interval_s=0.5, dead_after_missed=20)
        coord = await start_coordinator(tmp_path, ck, spec)
        members = list(await asyncio.gather(*(start_member(spec, coord.host.addrs[0]) for _ in range(7))))
        try:
            got: dict[str, list[int]] = {m.key.peer_id: [] for m in members}
            for m in members:
                async def on_policy(msg, pid=m.key.peer_id):
                    got[pid].append(msg.version)
                m.on_policy.append(on_policy)
            await mesh_formed(coord, members)
            await coord.announce_policy(0, "ab" * 32)
            await eventually(lambda: all(v == [0] for v in got.values()), 30, "announce reaches all 7 members",
                             progress=lambda: sum(map(len, got.values())))
            # Peers found each other through the network, not only through the bootstrap.
            assert any(len(m.host.connected_peers()) > 1 for m in members)
        finally:
            await stop_all(coord, members)
    run(body())
