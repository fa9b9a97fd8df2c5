"""The run's end and bans stop members (issue 17, item 4): when the trainer reports its last step the
coordinator announces the end and every member stops (exit code 0), the coordinator too after a
grace; a banned member stops with EXIT_BANNED and says why, instead of retrying forever."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

from protocol_testnet import WAIT_S, eventually, make_spec, mesh_formed, run, start_coordinator, start_member, stop_all

from node.run_config import RunConfig, to_toml
from node.sim_procs import free_port
from protocol.client import ONCE, CoordinatorClient, RunStop
from protocol.coordinator import Coordinator
from protocol.errors import BannedPeer
from protocol.identity import NodeKey
from protocol.member import EXIT_BANNED

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_trainers_last_step_ends_the_run_for_every_member_and_the_coordinator(tmp_path):
    async def body():
        ck, tk = NodeKey.generate(), NodeKey.generate()
        spec = make_spec(ck, run_id="end", trainer=tk.peer_id, heartbeat_interval_s=0.3)
        coord = await start_coordinator(tmp_path, ck, spec)
        trainer = await start_member(spec, coord.host.addrs[0], role="trainer", key=tk)
        others = [await start_member(spec, coord.host.addrs[0], role=r) for r in ("inference", "validator")]
        stops = [RunStop() for _ in others]
        for m, s in zip(others, stops):
            CoordinatorClient(m, stop=s)
        try:
            await mesh_formed(coord, [trainer, *others])  # the end is gossiped
            await CoordinatorClient(trainer, retry=ONCE).end_run(7)
            await eventually(lambda: all(s.is_set() for s in stops), WAIT_S, "every member told the run ended")
            assert [(s.exit_code, s.why) for s in stops] == [(0, "the run ended at trainer step 7")] * 2
            await asyncio.wait_for(coord.ended.wait(), 10)  # the launcher then exits 0
            assert coord.state.store.get_meta("ended_at_step") == "7"
        finally:
            await stop_all(coord, [trainer, *others])
    run(body())


def test_the_coordinator_ends_once_every_member_has_left_without_waiting_out_its_grace(tmp_path):
    async def body():
        ck, tk = NodeKey.generate(), NodeKey.generate()
        spec = make_spec(ck, run_id="end-left", trainer=tk.peer_id, heartbeat_interval_s=0.5, dead_after_missed=100)
        grace = spec.heartbeat_interval_s * spec.dead_after_missed  # 50 s
        coord = await start_coordinator(tmp_path, ck, spec)
        trainer = await start_member(spec, coord.host.addrs[0], role="trainer", key=tk)
        other = await start_member(spec, coord.host.addrs[0], role="inference")
        stop = RunStop()
        CoordinatorClient(other, stop=stop)
        try:
            await mesh_formed(coord, [trainer, other])  # the end and the leaves are gossiped
            t0 = time.monotonic()
            await CoordinatorClient(trainer, retry=ONCE).end_run(3)
            await eventually(stop.is_set, WAIT_S, "the member told the run ended")
            await trainer.leave("trainer stopping")
            await eventually(lambda: tk.peer_id not in coord.state.view.members, WAIT_S, "the trainer's leave heard")
            assert not coord.ended.is_set()  # a member is left that may not have heard it yet
            await other.leave("the run ended")
            await asyncio.wait_for(coord.ended.wait(), WAIT_S)
            assert time.monotonic() - t0 < grace
        finally:
            await stop_all(coord, [trainer, other])
    run(body())


def test_a_banned_member_stops_with_its_exit_code_and_cannot_join_again(tmp_path):
    async def body():
        ck = NodeKey.generate()
        spec = make_spec(ck, run_id="ban")
        coord = await start_coordinator(tmp_path, ck, spec)
        member = await start_member(spec, coord.host.addrs[0])
        stop = RunStop()
        CoordinatorClient(member, stop=stop)
        try:
            await mesh_formed(coord, [member])  # the ban is gossiped
            await coord.ban(member.key.peer_id, "work 3 failed verification: hidden_mismatch")
            await eventually(stop.is_set, WAIT_S, "the banned member stops")
            assert stop.exit_code == EXIT_BANNED and "hidden_mismatch" in stop.why
            again = RunStop()
            try:
                await CoordinatorClient.connect(member.key, spec, "inference", coord.host.addrs[0], again)
                raise AssertionError("a banned key joined again")
            except BannedPeer:
                pass
            assert again.exit_code == EXIT_BANNED
        finally:
            await stop_all(coord, [member])
    run(body())


def test_join_cli_of_a_banned_node_exits_with_its_code_and_a_clear_message(tmp_path):
    """A real `primerl-node join` process against a real `coordinator launch` whose state bans it."""
    ck, tk, banned = NodeKey.generate(), NodeKey.generate(), NodeKey.generate()
    ck.save(tmp_path / "coord.key")
    banned.save(tmp_path / "banned.key")
    (tmp_path / "run.toml").write_text(to_toml({"run_id": "banned", "trainer": tk.peer_id, "verification_rate": 0.0,
                                                 "listen": f"/ip4/127.0.0.1/tcp/{free_port()}", "status_port": 0}))
    spec = RunConfig.load(tmp_path / "run.toml").run_spec(ck.peer_id)
    (tmp_path / "state").mkdir()
    state = Coordinator(tmp_path / "state", spec)
    state.ban(banned.peer_id, "work 9 failed verification: reward_mismatch", time.time())
    state.close()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    coord = subprocess.Popen([sys.executable, "-m", "node.cli", "coordinator", "launch", "--config",
                              str(tmp_path / "run.toml"), "--state", str(tmp_path / "state"), "--key",
                              str(tmp_path / "coord.key"), "--addr-file", str(tmp_path / "addr")],
                             cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300  # a hang guard: an exit ends the wait at once
        while not (tmp_path / "addr").exists():
            assert coord.poll() is None and time.monotonic() < deadline, "coordinator did not start"
            time.sleep(0.1)
        bootstrap = (tmp_path / "addr").read_text().splitlines()[0]
        out = subprocess.run([sys.executable, "-m", "node.cli", "join", "--role", "inference", "--bootstrap", bootstrap,
                              "--key", str(tmp_path / "banned.key"), "--workdir", str(tmp_path / "node")],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    finally:
        coord.terminate()
        coord.wait(20)
    assert out.returncode == EXIT_BANNED, out.stderr[-2000:]
    assert "banned" in out.stderr and "reward_mismatch" in out.stderr and "Traceback" not in out.stderr
