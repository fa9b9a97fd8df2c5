"""A coordinator that stops (SIGTERM, or the run's end) never answers a request from a closed state:
in the docs/node.md walk-through a validator asking during the shutdown got "InternalError:
ProgrammingError" (SQLite closed before the libp2p host stopped serving) and exited 2."""

from __future__ import annotations

import asyncio
import signal

from protocol_testnet import run
from test_coordinator_crash import publish_version_zero, start_coordinator_process

from node.sim_procs import free_port
from protocol.client import ONCE, CoordinatorClient
from protocol.errors import ProtocolError, Refused
from protocol.identity import NodeKey
from protocol.member import RunMember
from protocol.transport import PeerHost

MEMBERS = 3


def test_requests_during_a_coordinator_shutdown_never_meet_a_closed_state(tmp_path):
    proc, addr = start_coordinator_process(tmp_path, "1", {"run_id": "stop", "batch_groups": 256,
                                                           "listen": f"/ip4/127.0.0.1/tcp/{free_port()}"})
    publish_version_zero(tmp_path, addr)
    from protocol.messages import RunSpec
    spec = RunSpec.model_validate_json((tmp_path / "state" / "spec.json").read_bytes())
    refusals: list[str] = []
    answered = [0]

    async def body() -> None:
        hosts = [PeerHost(NodeKey.generate()) for _ in range(MEMBERS)]
        for h in hosts:
            await h.start()
        members = [RunMember(h.key, h, spec, "inference", request_timeout=3) for h in hosts]
        stop = asyncio.Event()

        async def ask(member: RunMember) -> None:
            client = CoordinatorClient(member, retry=ONCE)
            while not stop.is_set():
                try:
                    await client.lease(1)
                    answered[0] += 1
                except Refused as exc:
                    refusals.append(exc.reason)
                except ProtocolError:
                    await asyncio.sleep(0.05)  # gone: the transport says so, which is fine
        try:
            for m in members:
                await m.join(addr)
            tasks = [asyncio.create_task(ask(m)) for m in members]
            await asyncio.sleep(2)
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 30)
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*tasks)
        finally:
            for m in members:
                await m.crash()
            for h in hosts:
                await h.stop()

    try:
        run(body())
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert answered[0] > 0
    assert "InternalError" not in refusals, refusals[-5:]
    text = (tmp_path / "coordinator-1.log").read_text()
    assert "request handler failed" not in text and "ProgrammingError" not in text, text[-3000:]
