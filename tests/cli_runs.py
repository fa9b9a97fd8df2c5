"""Command lines of the project run as real OS processes at the same time (each one's start-up, mostly
imports, overlaps the others'), for tests that check several one-line refusals."""

from __future__ import annotations

import os
import subprocess
import sys


def cli(*args: str, env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """`python -m node.cli ARGS` with one torch thread (and `env` on top of this process's)."""
    return [sys.executable, "-m", "node.cli", *args], dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))


def run_at_once(commands: list[tuple[list[str], dict[str, str]]], timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Start every (argv, env) at once and wait for them all; each must end within `timeout` s of the last
    start (a hang guard). Stops whatever is still running if one does not."""
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv, env in commands]
    try:
        done = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return done
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
