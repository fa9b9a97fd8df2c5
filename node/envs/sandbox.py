"""A sandbox for model-written Python: a security boundary, since inference nodes run whatever the
model writes. Invariant: the code runs in a child process that cannot outlive its wall-time limit,
reach the network, write outside its own scratch directory, read outside it and the Python
installation, exceed its CPU, memory, process, open-file and file-size limits, or load native code.

Layers (each alone stops most escapes; together they are the boundary):
1. Namespaces (util-linux `unshare`): a new network namespace (no interfaces but a down loopback),
   a new PID namespace whose init is killed with its parent, so no process survives the run, and a
   mount namespace where the scratch directory is bound over every world-writable directory.
   Without root, a user namespace is added so the above needs no privilege.
2. Kernel limits (setrlimit): CPU seconds, address space, file size, open files, processes, no core
   dumps. Run as root, the child drops to `nobody` first (root ignores RLIMIT_NPROC).
3. An audit hook (PEP 578) installed before the code runs, which cannot be removed from Python: it
   refuses sockets, subprocesses, exec/fork/spawn, ctypes/cffi/mmap imports, and opens outside the
   scratch directory (reads are allowed under the Python installation too).
The parent writes the child's stdout/stderr to files capped by RLIMIT_FSIZE, so a flood of output
cannot exhaust the node's memory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

_RUNNER = Path(__file__).with_name("sandbox_runner.py")
_WRITABLE_DIRS = ("/dev/shm", "/run/lock", "/var/tmp", "/tmp")
"""World-writable directories on Debian (`find / -xdev -type d -perm -0002`); /tmp last, since the
scratch directory itself lives under /tmp until then."""


class SandboxUnavailable(RuntimeError):
    """This host cannot build the sandbox (no `unshare`, or namespaces are forbidden)."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 2
    """CPU time before SIGXCPU/SIGKILL (RLIMIT_CPU)."""
    wall_seconds: float = 5.0
    """Wall time before the whole process tree is killed (catches sleeps and blocked reads)."""
    memory_bytes: int = 512 * 2**20
    """Address space (RLIMIT_AS); Python itself needs ~40 MiB of it."""
    file_bytes: int = 1 * 2**20
    """Largest file the code may write, stdout and stderr included (RLIMIT_FSIZE)."""
    max_processes: int = 8
    """Processes of the sandbox user (RLIMIT_NPROC); the audit hook refuses fork anyway."""
    max_open_files: int = 32
    """Open descriptors (RLIMIT_NOFILE)."""
    audit_hook: bool = True
    """The in-process layer; only tests turn it off, to show the kernel layers hold alone."""


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    wall_seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _interpreter() -> str:
    """Run as root, the child becomes `nobody`, who must be able to read the interpreter's standard
    library: this venv's base Python may live under /root (pyenv), so prefer the system Python.
    The sandboxed code gets the standard library only, never this project's packages."""
    if os.geteuid() == 0 and os.access("/usr/bin/python3", os.X_OK):
        return "/usr/bin/python3"
    return sys.executable


def _namespace_prefix() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SandboxUnavailable("util-linux `unshare` is not installed")
    prefix = [unshare, "--net", "--pid", "--fork", "--kill-child", "--mount"]
    if os.geteuid() != 0:
        prefix[1:1] = ["--user", "--map-root-user"]
    return prefix


def run_python(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(),
               files: dict[str, str] | None = None) -> SandboxResult:
    """Run `code` as a script in a fresh scratch directory holding `files`; never raises for
    anything the code does (errors come back as a non-zero return code and stderr)."""
    outer = Path(tempfile.mkdtemp(prefix="primerl-sandbox-"))
    scratch = outer / "work"
    scratch.mkdir()
    outer.chmod(0o711)  # the child may pass through to its scratch directory, not list or read here
    try:
        (scratch / "main.py").write_text(code)
        for name, text in (files or {}).items():
            if "/" in name or name.startswith("."):
                raise ValueError(f"sandbox file names are plain names, not {name!r}")
            (scratch / name).write_text(text)
        runner = scratch / ".runner.py"  # visible after the binds, readable by nobody, not writable
        shutil.copyfile(_RUNNER, runner)
        runner.chmod(0o644)
        if os.geteuid() == 0:  # the child drops to nobody; it must own its scratch directory
            for p in [scratch, *scratch.iterdir()]:
                if p != runner:
                    os.chown(p, 65534, 65534)
        # In the private mount namespace the scratch directory is bind-mounted over every
        # world-writable directory (/tmp, /var/tmp, /run/lock) and /dev/shm, so even code past the
        # audit hook finds nowhere else to write; the bind survives in the child's view only.
        binds = " && ".join(f"mount --bind {scratch} {d}" for d in _WRITABLE_DIRS if os.path.isdir(d))
        launch = (f"{binds} && exec {_interpreter()} -I -S /tmp/.runner.py /tmp "
                  f"'{json.dumps(asdict(limits))}'")
        cmd = [*_namespace_prefix(), "/bin/sh", "-c", launch]
        with open(outer / "stdout", "wb") as out, open(outer / "stderr", "wb") as err:
            started = time.monotonic()
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                    start_new_session=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
            timed_out = False
            try:
                proc.communicate(stdin.encode(), timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            except BrokenPipeError:
                pass
            finally:
                # Killing unshare kills the namespace's init (--kill-child), and with it every
                # process in the namespace, including any that left our process group.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            elapsed = time.monotonic() - started
        read = lambda name: (outer / name).read_bytes()[: limits.file_bytes].decode("utf-8", "replace")
        return SandboxResult(read("stdout"), read("stderr"), proc.returncode, timed_out, elapsed)
    finally:
        shutil.rmtree(outer, ignore_errors=True)
