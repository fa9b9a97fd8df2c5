"""The OS processes of `primerl-node sim` and the chaos benchmark: one per role, restartable with the same
key and state, each in its own session (signals reach the role, not the launcher), placed on its GPU."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from node.distributed.ports import free_port  # noqa: F401 (the sim's, the chaos benchmark's and tests' ports)

log = logging.getLogger(__name__)


class Proc:
    """One role process; restartable with the same key and state directory. With `launcher`
    (torchrun's arguments), the role runs as that many processes under torchrun."""

    def __init__(self, name: str, argv: list[str], log_path: Path, launcher: list[str] = (), module: str = "node.cli"):
        self.name, self.log_path, self.launcher = name, log_path, list(launcher)
        self.env: dict[str, str] = {}
        if "--device" in argv and argv[argv.index("--device") + 1].startswith("cuda:"):
            # the role sees only its GPU (as cuda:0): kernels that launch on the current device (Triton's,
            # CUDA graphs) then run where its tensors are, in every thread of the process
            i = argv.index("--device") + 1
            self.env["CUDA_VISIBLE_DEVICES"] = argv[i].removeprefix("cuda:")
            argv = [*argv[:i], "cuda:0", *argv[i + 1:]]
        self.argv = argv
        self.module = module
        """The program: `primerl-node` (node.cli), or node.adversary for a cheater."""
        self.p: subprocess.Popen | None = None
        self.events: list[tuple[float, str]] = []
        self._cpu_done = self._cpu_seen = 0.0

    @property
    def cpu_s(self) -> float:
        """CPU seconds (user + system, with its waited-for children) of every incarnation so far, as last
        read from /proc (`sample_cpu`; the sim reads it every poll and before each signal)."""
        return self._cpu_done + self._cpu_seen

    def sample_cpu(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self._cpu_seen = max(self._cpu_seen, _cpu_of(self.p.pid))

    def start(self) -> None:
        self._cpu_done, self._cpu_seen = self.cpu_s, 0.0
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", **self.env)
        self.p = subprocess.Popen([sys.executable, *self.launcher, "-m", self.module, "--log-level", "INFO", *self.argv],
                                  stdout=self.log_path.open("a"), stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
        self.events.append((time.time(), "start"))

    def kill(self) -> None:
        self.sample_cpu()
        if self.p and self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait(10)
            self.events.append((time.time(), "kill"))

    def stop(self, timeout: float = 20) -> None:
        self.sample_cpu()
        if self.p and self.p.poll() is None:
            # Under torchrun the ranks get the SIGTERM (rank 0 stops them all, torchrun then exits
            # with their status); torchrun itself, signalled, would exit non-zero whatever they do.
            for pid in _children(self.p.pid) if self.launcher else [self.p.pid]:
                _signal(pid, signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs of SIGTERM: its stacks go to its log, then SIGKILL",
                            self.name, timeout)
                roles = _children(self.p.pid) if self.launcher else [self.p.pid]
                for sig in (signal.SIGUSR2, signal.SIGUSR1):  # asyncio tasks (node/roles/common.py), threads (node/cli.py)
                    for pid in roles:
                        _signal(pid, sig)
                    time.sleep(0.5)
                for pid in roles if self.launcher else []:  # torchrun's ranks are in sessions of their own
                    _signal(pid, signal.SIGKILL)
                self.p.kill()
                self.p.wait(5)
            self.events.append((time.time(), "stop"))

    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None


def _cpu_of(pid: int) -> float:
    """utime + stime + cutime + cstime of `pid` in seconds (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def wait_for(path: Path, proc: Proc, timeout: float) -> str:
    end = time.time() + timeout
    while time.time() < end:
        if path.exists():
            return path.read_text()
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited; see {proc.log_path}")
        time.sleep(0.1)
    raise TimeoutError(f"{proc.name} did not come up in {timeout}s")


def count_lines(path: Path) -> int:
    try:
        return sum(1 for _ in path.open())
    except OSError:
        return 0
