"""What an operator meets when `coordinator launch` cannot start: one clear line and exit 2, not a
traceback (the docs/node.md walk-through: a second launch on the same --state while the first ran
opened its state, then died on the status port with an OSError traceback; a listen address in use
started a coordinator with no address at all)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_runs import cli, run_at_once

from node.run_config import to_toml
from node.sim_procs import free_port
from protocol.identity import NodeKey

TRAINER, VALIDATOR = NodeKey.from_seed(b"t" * 32).peer_id, NodeKey.from_seed(b"v" * 32).peer_id


def config(path, listen_port: int, status_port: int = 0):
    path.write_text(to_toml({"run_id": "t1", "trainer": TRAINER, "validators": [VALIDATOR],
                             "listen": f"/ip4/127.0.0.1/tcp/{listen_port}", "status_port": status_port}))
    return path


def launch_command(cfg, state, addr_file=None) -> tuple[list[str], dict[str, str]]:
    argv, env = cli("coordinator", "launch", "--config", str(cfg), "--state", str(state))
    return argv + (["--addr-file", str(addr_file)] if addr_file is not None else []), env


def launch(cfg, state, addr_file) -> subprocess.Popen:
    argv, env = launch_command(cfg, state, addr_file)
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def time_wait_on(port: int) -> None:
    """Leave a connection from 127.0.0.1:port in TIME_WAIT (this side closes first)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        client.bind(("127.0.0.1", port))
        client.connect(server.getsockname())
        conn, _ = server.accept()
        client.close()
        conn.settimeout(30)  # a hang guard
        assert conn.recv(1) == b""  # the close reached the other end before it closes too: TIME_WAIT stays here
        conn.close()
        # the other end's FIN and the last ACK go through loopback in the kernel: wait until it shows the state
        deadline = time.monotonic() + 30
        while not in_time_wait(port):
            assert time.monotonic() < deadline, f"127.0.0.1:{port} never reached TIME_WAIT"
            time.sleep(0.01)


def in_time_wait(port: int) -> bool:
    """Whether the kernel holds a TCP socket bound to local `port` in TIME_WAIT (/proc/net/tcp state 06)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "06":
            return True
    return False


@pytest.mark.slow
def test_launch_refuses_a_state_dir_in_use_and_addresses_in_use_with_one_line_each(tmp_path):
    first = launch(config(tmp_path / "a.toml", free_port()), tmp_path / "state", tmp_path / "addr")
    peer = socket.socket()
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "addr").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate(timeout=10)
            time.sleep(0.2)
        listen_port = int((tmp_path / "addr").read_text().split("/tcp/")[1].split("/")[0])
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            # the three refusals at once: the same state directory, other ports (refused before anything in the
            # state is touched); a listen address in use (the first coordinator's); a status port in use
            same_state, listen_in_use, status_in_use = run_at_once([
                launch_command(config(tmp_path / "b.toml", free_port()), tmp_path / "state"),
                launch_command(config(tmp_path / "c.toml", listen_port), tmp_path / "state-c"),
                launch_command(config(tmp_path / "d.toml", free_port(), busy.getsockname()[1]), tmp_path / "state-d")],
                timeout=90)
        for out, says in ((same_state, "another coordinator"), (listen_in_use, "cannot listen on"),
                          (status_in_use, "cannot serve the status page on port")):
            text = out.stdout + out.stderr
            assert out.returncode == 2 and says in text and "Traceback" not in text, text
        assert first.poll() is None  # the running one is unharmed
        # a connection, so that the coordinator's SIGKILL leaves its port in TIME_WAIT
        peer.connect(("127.0.0.1", listen_port))
        peer.settimeout(60)  # a hang guard
        assert peer.recv(1)  # accepted: libp2p's listener speaks first (multistream-select's header)
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=30)
        peer.close()
    time_wait_on(listen_port)  # what the killed coordinator's connections from its port leave behind
    # the documented restart: the same run.toml and --state at once; the lock went with the process
    # and a port in TIME_WAIT is free (a first version of the listen check refused it)
    again = launch(tmp_path / "a.toml", tmp_path / "state", tmp_path / "addr2")
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "addr2").exists():
            assert again.poll() is None and time.monotonic() < deadline, again.communicate(timeout=10)
            time.sleep(0.2)
        assert f"/tcp/{listen_port}/" in (tmp_path / "addr2").read_text()
    finally:
        again.send_signal(signal.SIGTERM)
        again.communicate(timeout=30)
    assert again.returncode == 0


def test_a_member_with_an_unreachable_bootstrap_says_so_once_per_retry_formatted_and_stops_on_sigterm(tmp_path):
    # the walk-through: py-libp2p's dial errors reached stderr bare (no time, no logger), 4 per retry
    from protocol.messages import RunSpec

    spec = RunSpec(run_id="t1", coordinator=NodeKey.from_seed(b"c" * 32).peer_id, trainer=TRAINER,
                   validators=[VALIDATOR])
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    bootstrap = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{spec.coordinator}"
    proc = subprocess.Popen([sys.executable, "-m", "node.cli", "join", "--role", "relay", "--bootstrap", bootstrap,
                             "--spec", str(tmp_path / "spec.json"), "--workdir", str(tmp_path / "relay"),
                             "--shardcast-port", str(free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    said: list[str] = []

    def read() -> None:  # until its stdout closes
        for line in proc.stdout:
            said.append(line)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # three retries said (12 s alone, the start-up included), then the stop
        deadline = time.monotonic() + 180  # a hang guard: the third retry line ends the wait
        while sum("join failed" in line for line in said) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(said)[-2000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        reader.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    out = "".join(said)
    assert proc.returncode == 0, out[-2000:]
    lines = [line for line in out.splitlines() if line and not line.startswith("node id:")]
    retries = [line for line in lines if "join failed" in line and bootstrap.split("/p2p/")[0] in line]
    assert retries, out[-2000:]
    bare = [line for line in lines if not line[:8].replace(":", "").isdigit()]
    assert not bare, bare[:5]  # every line through the one formatter
    assert "Failed to open TCP stream" not in out
    assert len(lines) <= 3 * len(retries) + 6, out[-2000:]


def test_the_coordinator_starts_without_importing_torch():
    # restart time: the walk-through's coordinator took 7.7-8.1 s to listen under load 12, 2.5-5 s of it
    # importing torch through node.roles.common, node.engine and verification.checks; it runs no model
    code = ("import sys, node.cli\n"
            "node.cli.build_parser(['coordinator', 'launch', '--config', 'x'])\n"
            "import node.join_cli, node.run_config, node.roles.status, node.stop_signals, node.launch_guard\n"
            "import protocol.coordinator_service, verification.verdict\n"
            "from node.envs import get_env; get_env('reverse')\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr[-2000:]
