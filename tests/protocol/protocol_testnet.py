"""Helpers for protocol tests: real libp2p hosts on 127.0.0.1, a coordinator, members."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from protocol.client import ONCE, CoordinatorClient
from protocol.coordinator import Coordinator
from protocol.coordinator_service import CoordinatorService
from protocol.identity import NodeKey
from protocol.limits import ConnectionLimits
from protocol.member import RunMember
from protocol.messages import LeaseGrant, RunSpec
from protocol.transport import PeerHost


HANG_S = 300.0
"""A test body that has not ended after this long is stuck (every test process stops by itself).
Not a measure of speed: the 8-host gossip test's body took ~4 s alone and 27-60+ s at load 9-12 on
2 cores (cpu-2core, measured; once past the minute it had then), so a minute was not enough."""
WAIT_S = 30.0
"""How long `eventually` waits by default: a condition that holds ends the wait at once, so this
bounds only a failing test (the gossip test's mesh and announce waits, ~1 s each alone, took 11-12 s
at load 12 on 2 cores)."""


def run(coro: Awaitable, timeout: float = HANG_S):
    """Run one async test body, failing it if it hangs (see HANG_S)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def eventually(cond: Callable[[], bool], timeout: float = WAIT_S, what: str = "condition",
                     progress: Callable[[], object] | None = None) -> None:
    """Wait until `cond()`. It fails after `timeout` s; with `progress`, after `timeout` s in which
    `progress()` did not change (a loaded machine is slow, not stuck, while the thing waited for moves)."""
    deadline = time.monotonic() + timeout
    seen = progress() if progress else None
    while not cond():
        if progress is not None and (now := progress()) != seen:
            seen, deadline = now, time.monotonic() + timeout
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s{' without progress' if progress else ''} "
                                 f"waiting for {what}")
        await asyncio.sleep(0.05)


async def publish_until(host: PeerHost, topic: str, data: bytes, cond: Callable[[], bool], what: str,
                        timeout: float = WAIT_S) -> None:
    """Publish `data` on `topic` again until `cond()`: the first copies may go out before the gossip mesh
    has formed, and a gossip message is sent once. Fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s publishing until {what}")
        await host.publish(topic, data)
        for _ in range(5):  # polled every 0.05 s, published again every 0.25 s
            if cond():
                return
            await asyncio.sleep(0.05)


def heard(member: RunMember, peer_ids: set[str]) -> set[str]:
    """The peers among `peer_ids` whose gossiped heartbeat reached `member` (a join reply's member
    list is in the view too, with no beat: it does not count)."""
    return {p for p in peer_ids if p in member.view.members and member.view.members[p].last_seq >= 0}


async def mesh_formed(coordinator: CoordinatorService, members: list[RunMember], quiet_s: float = 30.0) -> None:
    """Wait until the gossip mesh carries every member's and the coordinator's heartbeats to every
    member, for as long as more of them arrive: only then does an announcement reach all."""
    ids = {m.key.peer_id for m in members} | {coordinator.key.peer_id}
    await eventually(lambda: all(heard(m, ids - {m.key.peer_id}) == ids - {m.key.peer_id} for m in members),
                     quiet_s, "the gossip mesh to carry every heartbeat to every member",
                     progress=lambda: sum(len(heard(m, ids)) for m in members))


def make_spec(coordinator: NodeKey, **kw) -> RunSpec:
    base = dict(run_id="test-run", coordinator=coordinator.peer_id, max_off_policy_steps=1,
                heartbeat_interval_s=0.3, dead_after_missed=3, lease_ttl_s=30.0)
    base.update(kw)
    return RunSpec(**base)


async def start_coordinator(directory: Path, key: NodeKey, spec: RunSpec, policy_version: int | None = None,
                            connection_limits: ConnectionLimits | None = None, defer_fsync: bool = True) -> CoordinatorService:
    """A coordinator service; with `policy_version`, that version is announced before anyone joins
    (leases are granted only once there is a policy); `connection_limits`: its host's (default: PeerHost's).
    Its store syncs as `coordinator launch`'s does (`defer_fsync`) unless told otherwise."""
    host = PeerHost(key, connection_limits=connection_limits)
    await host.start()
    service = CoordinatorService(key, Coordinator(directory, spec, defer_fsync=defer_fsync), host)
    await service.start()
    if policy_version is not None:
        await service.announce_policy(policy_version, "ab" * 32)
    return service


def client(member: RunMember) -> CoordinatorClient:
    """The member's coordinator client without retries (errors reach the test as they are)."""
    return CoordinatorClient(member, retry=ONCE)


async def lease_one(member: RunMember) -> LeaseGrant:
    grants = await client(member).lease(1)
    assert len(grants) == 1, "no work granted"
    return grants[0]


async def start_member(spec: RunSpec, bootstrap: str, role: str = "inference", key: NodeKey | None = None) -> RunMember:
    key = key or NodeKey.generate()
    host = PeerHost(key)
    await host.start()
    member = RunMember(key, host, spec, role)
    await member.join(bootstrap)
    return member


async def stop_all(coordinator: CoordinatorService | None, members: list[RunMember]) -> None:
    for m in members:
        await m.crash()
        await m.host.stop()
    if coordinator is not None:
        await coordinator.stop()
        coordinator.state.close()
        await coordinator.host.stop()
