"""A coordinator in its own process, killed with SIGKILL mid-traffic and restarted: every
rollout it acknowledged is still there, leases and membership survive, and a retry of an
acknowledged rollout is recognised as a duplicate (not counted twice)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from protocol_testnet import WAIT_S, eventually, run

from node.run_config import to_toml
from protocol.client import ONCE, CoordinatorClient
from protocol.coordinator import Coordinator
from protocol.errors import ProtocolError
from protocol.identity import NodeKey
from protocol.member import RunMember
from protocol.messages import RolloutSubmission, RunSpec
from protocol.pipeline import LeasePolicy
from protocol.transport import PeerHost

REPO = Path(__file__).resolve().parents[2]


def start_coordinator_process(tmp: Path, tag: str, config: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`primerl-node coordinator launch` on tmp/run.toml (written from `config` on the first start),
    state in tmp/state, key tmp/coord.key; returns the process and its bootstrap multiaddr."""
    if config is not None:  # a run names its trainer (publish_version_zero's key); nothing is verified here
        (tmp / "run.toml").write_text(to_toml({"listen": "/ip4/127.0.0.1/tcp/0", "status_port": 0,
                                               "trainer": trainer_key(tmp).peer_id, "verification_rate": 0.0,
                                               **config}))
    addr_file = tmp / f"addr-{tag}"
    log = open(tmp / f"coordinator-{tag}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "node.cli", "coordinator", "launch", "--config", str(tmp / "run.toml"),
                             "--state", str(tmp / "state"), "--key", str(tmp / "coord.key"), "--addr-file", str(addr_file)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 300  # a hang guard: an exit ends the wait at once
    while not addr_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"coordinator did not start: {(tmp / f'coordinator-{tag}.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return proc, addr_file.read_text().splitlines()[0]


def trainer_key(tmp: Path) -> NodeKey:
    """The run's trainer key (one per test directory)."""
    path = tmp / "trainer.key"
    if not path.exists():
        NodeKey.generate().save(path)
    return NodeKey.load(path)


def publish_version_zero(tmp: Path, addr: str) -> RunSpec:
    """The run's spec; a trainer member has the coordinator announce policy version 0 (leases need one)."""
    spec = RunSpec.model_validate_json((tmp / "state" / "spec.json").read_bytes())

    async def go() -> None:
        host = PeerHost(trainer_key(tmp))
        await host.start()
        trainer = RunMember(host.key, host, spec, "trainer")
        await trainer.join(addr)
        await CoordinatorClient(trainer, retry=ONCE).announce(0, "00" * 32)
        await trainer.leave()
        await host.stop()
    run(go())
    return spec


def rollout(work_id: int) -> RolloutSubmission:
    return RolloutSubmission(work_id=work_id, version_runs=[(0, 8)], token_ids=list(range(8)), logprobs=[-0.5] * 8,
                             reward=float(work_id), proof=b"\x01" * 258, finish_reason="eos")


@pytest.mark.slow
def test_sigkilled_coordinator_restarts_without_losing_an_accepted_rollout(tmp_path):
    # batch_groups: room for every lease this test takes (nothing is batched here); groups of one, so a
    # bare rollout is a whole unit (protocol.work.unit_group)
    proc, addr = start_coordinator_process(tmp_path, "1", {"run_id": "crash-run", "max_off_policy_steps": 2,
                                                           "heartbeat_interval_s": 1.0, "lease_ttl_s": 120,
                                                           "batch_groups": 4096, "group_size": 1})
    spec = publish_version_zero(tmp_path, addr)
    acked: set[int] = set()
    held: list[int] = []

    async def body() -> None:
        host = PeerHost(NodeKey.generate())
        await host.start()
        member = RunMember(host.key, host, spec, "inference", request_timeout=5)
        coordinator = CoordinatorClient(member, retry=ONCE)

        async def lease() -> int:
            grants = await coordinator.lease(1)
            assert grants, "no work granted"
            return grants[0].work_id
        try:
            await member.join(addr)
            for _ in range(10):
                w = await lease()
                assert (await coordinator.submit(rollout(w))).accepted
                acked.add(w)

            async def one() -> None:
                w = await lease()
                held.append(w)
                if (await coordinator.submit(rollout(w))).accepted:
                    acked.add(w)

            failed = [0]

            async def flood() -> None:
                while True:
                    # fewer at once than a newcomer may hold (LeasePolicy.new_allowance): leases the kill granted
                    # but never answered stay this identity's after the restart, and one must be left to lease
                    done = await asyncio.gather(*(one() for _ in range(LeasePolicy().new_allowance - 1)),
                                                return_exceptions=True)
                    failed[0] += sum(isinstance(d, Exception) for d in done)

            flooder = asyncio.create_task(flood())
            # mid-traffic (20 more acknowledged under the flood), no chance to flush anything
            await eventually(lambda: len(acked) >= 30, WAIT_S, "the flood's first acknowledgements",
                             progress=lambda: len(acked))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            before = failed[0]
            await eventually(lambda: failed[0] > before, WAIT_S, "the flood meeting the dead coordinator")
            flooder.cancel()
            await asyncio.gather(flooder, return_exceptions=True)
            assert len(acked) > 10

            proc2, addr2 = start_coordinator_process(tmp_path, "2")
            try:
                await host.connect(addr2)
                # Membership and leases survived: the held-but-unacknowledged work can still be submitted.
                unacked = [w for w in held if w not in acked]
                for w in unacked:
                    try:
                        if (await coordinator.submit(rollout(w))).accepted:
                            acked.add(w)
                    except ProtocolError:
                        pass  # e.g. the lease request itself never reached the disk before the kill
                some = min(acked)
                retry = await coordinator.submit(rollout(some))
                assert retry.accepted and retry.duplicate
                w = await lease()
                assert w not in acked
                assert (await coordinator.submit(rollout(w))).accepted
                acked.add(w)
            finally:
                proc2.send_signal(signal.SIGTERM)
                proc2.wait(20)
        finally:
            await member.crash()
            await host.stop()

    try:
        run(body())
    finally:
        if proc.poll() is None:
            proc.kill()
    state = Coordinator(tmp_path / "state", spec)
    stored = {r.work_id: r for r in state.accepted_rollouts()}
    assert acked <= set(stored), f"lost {sorted(acked - set(stored))}"
    assert set(stored) == acked  # and nothing stored was never acknowledged... unless its ack was lost in the kill
    for w in acked:
        assert state.load_rollout(stored[w]).reward == float(w)  # signed bytes intact and re-verifiable
    state.close()
