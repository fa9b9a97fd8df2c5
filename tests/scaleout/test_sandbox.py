"""The coding sandbox holds: each escape is refused by the audit hook, and again by the kernel
layers alone (hook off); honest code runs and returns its output."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import pytest

from node.envs.sandbox import SandboxLimits, run_python

FAST = SandboxLimits(cpu_seconds=1, wall_seconds=3.0)
NO_HOOK = SandboxLimits(cpu_seconds=1, wall_seconds=3.0, audit_hook=False)


def _nobody_processes() -> int:
    out = subprocess.run(["ps", "-u", "65534", "--no-headers"], capture_output=True, text=True)
    return len(out.stdout.splitlines())


def test_honest_code_runs_reads_stdin_and_writes_its_scratch_directory():
    code = "import math, json\nopen('a.txt', 'w').write('7')\nprint(int(input()) * int(open('a.txt').read()), math.isqrt(17))"
    r = run_python(code, stdin="6\n", limits=FAST)
    assert r.ok and r.stdout == "42 4\n", r


@pytest.mark.parametrize("limits", [FAST, NO_HOOK], ids=["hook", "kernel-only"])
def test_infinite_loop_is_stopped_by_cpu_limit(limits):
    started = time.monotonic()
    r = run_python("while True:\n    pass\n", limits=limits)
    assert not r.ok
    assert time.monotonic() - started < limits.wall_seconds + 2


def test_sleeping_code_is_killed_at_wall_time():
    r = run_python("import time\ntime.sleep(60)\n", limits=FAST)
    assert r.timed_out and not r.ok and r.wall_seconds < FAST.wall_seconds + 1


@pytest.mark.parametrize("limits", [FAST, NO_HOOK], ids=["hook", "kernel-only"])
def test_large_allocation_fails_inside_the_sandbox(limits):
    r = run_python("x = bytearray(3 * 1024**3)\nprint('allocated')\n", limits=limits)
    assert not r.ok and "MemoryError" in r.stderr and "allocated" not in r.stdout


def test_fork_is_refused_by_the_hook():
    r = run_python("import os\nwhile True:\n    os.fork()\n", limits=FAST)
    assert not r.ok and "os.fork is not allowed" in r.stderr


def test_fork_bomb_without_the_hook_is_capped_and_leaves_no_process_behind():
    before = _nobody_processes()
    bomb = ("import os, time\nmade = 0\nfor _ in range(2000):\n    try:\n        if os.fork() == 0:\n"
            "            made = 0\n    except OSError:\n        break\n    else:\n        made += 1\n"
            "print('forked', made, flush=True)\ntime.sleep(60)\n")
    r = run_python(bomb, limits=NO_HOOK)
    assert r.timed_out
    counts = [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("forked")]
    assert counts and sum(counts) < 2 * NO_HOOK.max_processes  # RLIMIT_NPROC capped the bomb
    deadline = time.monotonic() + 3  # the kernel reaps the namespace's processes asynchronously
    while _nobody_processes() > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _nobody_processes() <= before  # the PID namespace took every process with it


@pytest.fixture
def tcp_server():
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(5)
    accepted = []

    def serve():
        try:
            conn, _ = srv.accept()
            accepted.append(conn.recv(16))
            conn.close()
        except OSError:
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield srv.getsockname()[1], accepted
    srv.close()
    thread.join(6)


@pytest.mark.parametrize("limits", [FAST, NO_HOOK], ids=["hook", "kernel-only"])
def test_network_is_unreachable(tcp_server, limits):
    port, accepted = tcp_server
    code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "s.sendall(b'escaped')\nprint('connected')\n")
    r = run_python(code, limits=limits)
    assert not r.ok and "connected" not in r.stdout
    # The same server takes a connection from outside the sandbox (the check is not vacuous).
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"honest")
    time.sleep(0.2)
    assert accepted == [b"honest"]


@pytest.mark.parametrize("limits", [FAST, NO_HOOK], ids=["hook", "kernel-only"])
def test_files_outside_the_scratch_directory_cannot_be_written_or_read(tmp_path, limits):
    secret = tmp_path / "node.key"
    secret.write_text("private key")
    secret.chmod(0o600)
    project_file = os.path.abspath(__file__)
    target = f"/var/lib/escaped-{os.getpid()}"
    code = (f"results = []\nfor path, mode in [({str(secret)!r}, 'r'), ({target!r}, 'w'), ('/etc/escaped', 'w'),"
            f" ({project_file!r}, 'a')]:\n    try:\n        f = open(path, mode)\n"
            "        results.append('OPENED ' + path)\n    except OSError as e:\n        results.append('refused')\n"
            "print(results)\n")
    r = run_python(code, limits=limits)
    assert "OPENED" not in r.stdout
    assert not os.path.exists(target) and not os.path.exists("/etc/escaped")
    assert secret.read_text() == "private key"


def test_writes_to_tmp_land_in_the_scratch_directory_not_the_hosts(tmp_path):
    marker = f"/tmp/primerl-escape-{os.getpid()}"
    r = run_python(f"open({marker!r}, 'w').write('x')\nprint(open({marker!r}).read())\n", limits=NO_HOOK)
    assert r.ok and r.stdout == "x\n"
    assert not os.path.exists(marker)


def test_native_code_and_subprocesses_are_refused():
    for code, word in [("import ctypes\n", "ctypes"), ("import subprocess\nsubprocess.run(['id'])\n", "subprocess"),
                       ("import os\nos.system('id')\n", "os.system")]:
        r = run_python(code, limits=FAST)
        assert not r.ok and "not allowed" in r.stderr and word in r.stderr, r


def test_output_flood_is_capped():
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=3.0, file_bytes=64 * 1024)
    r = run_python("while True:\n    print('x' * 1000)\n", limits=limits)
    assert not r.ok and len(r.stdout) <= limits.file_bytes
