"""Start, watch and stop a vLLM API server process. Invariant: the server never outlives the node
(it runs in its own process group, killed on `stop`, on the context manager's exit, at exit, and by
a watchdog process when the node dies without running any of those, e.g. SIGKILL).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from contrib.vllm.settings import VLLMSettings, server_args, server_env

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[2]


class VLLMServerError(RuntimeError):
    """The vLLM server did not start, died, or answered an RPC with an error."""


class VLLMUnavailable(VLLMServerError):
    """No usable vLLM interpreter: PRIMERL_VLLM_PYTHON unset, not an executable, or without vLLM."""


STOP_GRACE_S = 5.0
"""After SIGTERM the server's group gets this long before SIGKILL (vLLM ignores SIGTERM for 20+ s
while it starts up; the node's own shutdown grace is 15 s)."""
WATCHDOG = ("import os, signal, sys\n"
            "sys.stdin.buffer.read()\n"  # EOF: the node is gone (its end of the pipe closed, however it exited)
            "try:\n    os.killpg(int(sys.argv[1]), signal.SIGKILL)\nexcept ProcessLookupError:\n    pass\n")
"""Run beside the server: kills the server's process group once the node's end of a pipe closes."""

PYTHON_ENV = "PRIMERL_VLLM_PYTHON"
"""Names the interpreter of the environment vLLM is installed in (never this node's own)."""


def vllm_python(python: str | None = None, timeout: float = 60.0) -> str:
    """The vLLM interpreter (`python`, else $PRIMERL_VLLM_PYTHON), checked to run and to find the
    `vllm` package (without importing it: seconds, not the ~10 s of `import vllm`)."""
    python = python or os.environ.get(PYTHON_ENV)
    if not python:
        raise VLLMUnavailable(f"{PYTHON_ENV} is not set: point it at the python of the environment vLLM is "
                              "installed in (e.g. `make .venv-vllm/.installed`, then .venv-vllm/bin/python)")
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise VLLMUnavailable(f"{PYTHON_ENV}={python} is not an executable file")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VLLMUnavailable(f"{PYTHON_ENV}={python} does not run: {exc}") from exc
    if done.returncode != 0:
        raise VLLMUnavailable(f"{PYTHON_ENV}={python} has no `vllm` package (exit {done.returncode}: "
                              f"{done.stderr.decode(errors='replace')[-300:]})")
    return python


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class VLLMServer:
    def __init__(self, settings: VLLMSettings, python: str | None = None, log_path: str | Path | None = None):
        """`python`: the interpreter of the environment vLLM is installed in (PRIMERL_VLLM_PYTHON,
        else this one)."""
        self.settings = settings
        self.python = python or os.environ.get(PYTHON_ENV) or sys.executable
        self.port = settings.port or _free_port(settings.host)
        self.url = f"http://{settings.host}:{self.port}"
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self._watchdog: subprocess.Popen | None = None
        self._lifeline: int | None = None

    def command(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", *server_args(self.settings, self.port)]

    def start(self, timeout: float = 300.0, cancel: threading.Event | None = None) -> "VLLMServer":
        """Start and wait until healthy; `cancel` set meanwhile stops the server and raises."""
        env = dict(os.environ, **server_env(self.settings))
        # The worker extension is imported by vLLM's workers from this checkout.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        log.info("starting vLLM: %s", " ".join(self.command()))
        self.proc = subprocess.Popen(self.command(), env=env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=REPO_ROOT)
        atexit.register(self.stop)
        self._start_watchdog()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cancel is not None and cancel.is_set():
                self.stop()
                raise VLLMServerError("vLLM start-up cancelled")
            if self.proc.poll() is not None:
                raise VLLMServerError(f"vLLM exited with {self.proc.returncode} during start-up"
                                      + (f"; see {self.log_path}" if self.log_path else ""))
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        log.info("vLLM ready at %s", self.url)
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise VLLMServerError(f"vLLM not ready after {timeout:.0f} s")

    def _start_watchdog(self) -> None:
        read, self._lifeline = os.pipe()  # both ends non-inheritable: the server never holds the write end
        try:
            self._watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(self.proc.pid)], stdin=read,
                                              start_new_session=True)
        finally:
            os.close(read)

    def post(self, path: str, body: dict | None = None, timeout: float = 120.0) -> dict:
        """POST JSON to the server; typed error on HTTP failure."""
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            raise VLLMServerError(f"{path}: HTTP {exc.code}: {exc.read()[:500]!r}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise VLLMServerError(f"{path}: {exc}") from exc
        return json.loads(raw) if raw else {}

    def rpc(self, method: str, timeout: float = 300.0, **kwargs) -> list:
        """Call a worker-extension method on every worker; returns each worker's result."""
        return self.post("/collective_rpc", {"method": method, "kwargs": kwargs}, timeout)["results"]

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        if self.proc is not None:
            try:  # workers left in the group after the server itself exited
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
            self._watchdog.wait(timeout=10)

    def __enter__(self) -> "VLLMServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
