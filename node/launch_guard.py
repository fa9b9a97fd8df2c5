"""What `coordinator launch` makes sure of before it starts: its state directory is its own, its
listen address is free. Either failing is a `LaunchError`: one line for the operator, exit 2.

One process per state directory: a coordinator holds an exclusive lock on `STATE/LOCK_NAME`.

Two coordinators on one `--state` would both write its SQLite state, replay guard and segments
(and, with another listen port, both claim to be the run's coordinator). The lock is an OS file lock
(`fcntl.flock`): the kernel drops it when the process exits, SIGKILL included, so a crashed
coordinator never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

LOCK_NAME = "coordinator.lock"


class LaunchError(RuntimeError):
    """A role cannot start as asked: an address in use, another coordinator on --state, a --spec that is
    missing or of another coordinator."""


class StateInUse(LaunchError):
    """Another live process holds the state directory."""


class StateLock:
    """Held from `acquire` until `release` or the process exits."""

    def __init__(self, state: Path):
        self.path = Path(state) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "StateLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StateInUse(f"another coordinator (pid {holder}) is running with --state {self.path.parent}; "
                             "stop it first (one coordinator per state directory)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def listen_free(listen: str) -> None:
    """py-libp2p listens with SO_REUSEPORT: a second coordinator on a port in use would share it with
    the first (the kernel splitting connections between them; seen in the walk-through). A plain bind
    finds the port taken. Port 0 (any free port) is not checked."""
    parts = listen.strip("/").split("/")
    if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp" or parts[3] == "0":
        return
    family = socket.AF_INET if parts[0] == "ip4" else socket.AF_INET6
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # a listener refuses this bind; the TIME_WAIT connections a killed coordinator leaves do not
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((parts[1], int(parts[3])))
        except OSError as exc:
            raise LaunchError(f"cannot listen on {listen} (run.toml `listen`): {exc.strerror or exc}") from None
