"""A coordinator that stops (SIGTERM, or the run's end) never answers a request from a closed state:
in the docs/node.md walk-through a validator asking during the shutdown got "InternalError:
ProgrammingError" (SQLite closed before the libp2p host stopped serving) and exited 2."""

from __future__ import annotations

import asyncio
import signal

from protocol_testnet import WAIT_S, eventually, run
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
    answered, failed = [0], [0]
    gone: set[str] = set()  # the members whose request met the stopped coordinator

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
                    failed[0] += 1
                    gone.add(member.key.peer_id)
                    await asyncio.sleep(0.05)  # gone: the transport says so, which is fine
        try:
            for m in members:
                await m.join(addr)
            tasks = [asyncio.create_task(ask(m)) for m in members]
            # the shutdown comes while all of them ask (3 requests each, some answered; an empty answer is held up
            # to a heartbeat interval, and on a loaded machine some time out)
            asked = lambda: answered[0] + len(refusals) + failed[0]
            await eventually(lambda: answered[0] > 0 and asked() >= 3 * MEMBERS, WAIT_S, "the members' first answers",
                             progress=asked)
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 30)
            # and they go on asking until each has met the closed coordinator
            gone.clear()
            await eventually(lambda: len(gone) == MEMBERS, WAIT_S, "the members meeting the stopped coordinator")
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
