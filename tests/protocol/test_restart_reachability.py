"""A restarted coordinator (same --state, same listen address) is reachable again within 10 s, and
its gossip is not dropped as equivocation (issue 17, item 4: members could not reach it for ~60 s,
and the trainer's log filled with "Equivocation detected")."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import pytest
from protocol_testnet import WAIT_S, eventually, run
from test_coordinator_crash import publish_version_zero, start_coordinator_process

from node.sim_procs import free_port
from protocol.client import CoordinatorClient, Retry
from protocol.identity import NodeKey
from protocol.member import RunMember
from protocol.transport import PeerHost


class _Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.equivocations = 0

    def emit(self, record):
        self.equivocations += "Equivocation" in record.getMessage()


@pytest.mark.slow
def test_members_reach_a_restarted_coordinator_within_10s_and_take_its_gossip(tmp_path):
    # heartbeats every 0.2 s: the first coordinator numbers gossip ~4 messages a second ahead of
    # the clock, which is what made a restarted one reuse numbers its members still remembered
    proc, addr = start_coordinator_process(tmp_path, "1", {"run_id": "restart", "heartbeat_interval_s": 0.2,
                                                           "listen": f"/ip4/127.0.0.1/tcp/{free_port()}"})
    spec = publish_version_zero(tmp_path, addr)
    count = _Count()
    logging.getLogger("libp2p.pubsub.gossipsub").addHandler(count)
    took: list[float] = []
    heard: list[float] = []

    async def body() -> None:
        host = PeerHost(NodeKey.generate())
        await host.start()
        member = RunMember(host.key, host, spec, "inference", request_timeout=3)
        client = CoordinatorClient(member, bootstrap=addr, retry=Retry(first_delay_s=0.2, max_delay_s=1.0))
        try:
            await member.join(addr)
            assert await client.lease(1)
            # the first coordinator's gossip numbering runs ahead: 30 of its heartbeats (6 s alone) reach the member
            beat = lambda: member.view.members[spec.coordinator].last_seq if spec.coordinator in member.view.members else -1
            await eventually(lambda: beat() >= 30, WAIT_S, "30 heartbeats of the first coordinator", progress=beat)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            proc2, addr2 = start_coordinator_process(tmp_path, "2")
            assert addr2 == addr  # same key, same listen address
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(client.lease(1), 30)
                took.append(time.monotonic() - t0)
                # the restarted coordinator's heartbeats reach the member (not dropped as duplicates)
                seen = member.view.members.get(spec.coordinator)
                last = seen.last_seq if seen else -1
                deadline = time.monotonic() + WAIT_S  # a hang guard: the first beat heard ends the wait
                while time.monotonic() < deadline:
                    seen = member.view.members.get(spec.coordinator)
                    if seen is not None and seen.last_seq != last and seen.last_seq < 100:
                        heard.append(time.monotonic() - t0)
                        break
                    await asyncio.sleep(0.1)
            finally:
                proc2.send_signal(signal.SIGTERM)
                proc2.wait(20)
        finally:
            await member.crash()
            await host.stop()

    try:
        run(body())
    finally:
        logging.getLogger("libp2p.pubsub.gossipsub").removeHandler(count)
        if proc.poll() is None:
            proc.kill()
    assert took and took[0] < 10, took
    assert heard, "no heartbeat of the restarted coordinator reached the member"
    assert count.equivocations == 0
