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
from protocol.member import RunMember
from protocol.messages import LeaseGrant, RunSpec
from protocol.transport import PeerHost


def run(coro: Awaitable, timeout: float = 60.0):
    """Run one async test body with a hard timeout (every test process stops by itself)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def eventually(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


def make_spec(coordinator: NodeKey, **kw) -> RunSpec:
    base = dict(run_id="test-run", coordinator=coordinator.peer_id, max_off_policy_steps=1,
                heartbeat_interval_s=0.3, dead_after_missed=3, lease_ttl_s=30.0)
    base.update(kw)
    return RunSpec(**base)


async def start_coordinator(directory: Path, key: NodeKey, spec: RunSpec,
                            policy_version: int | None = None) -> CoordinatorService:
    """A coordinator service; with `policy_version`, that version is announced before anyone joins
    (leases are granted only once there is a policy)."""
    host = PeerHost(key)
    await host.start()
    service = CoordinatorService(key, Coordinator(directory, spec), host)
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
