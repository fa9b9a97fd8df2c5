"""Free local ports: a world's rendezvous (node/engine/ep_spawn.py), the roles of a local run (node/sim.py).
Torch-free: the sim's own process never imports torch."""

from __future__ import annotations

import random
import socket


_HANDED_OUT: set[int] = set()
"""Ports this process has handed out: never twice (a sim picks every role's ports at once)."""


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections and `bind(0)` (Linux: 32768 by default)."""
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now, below the kernel's ephemeral range when there is room: a port from
    that range (what `bind(0)` gives) can be taken by any process's outgoing connection before it is bound
    again (seen: a sim's coordinator refused its status port, "address already in use"); one below it only
    by a process that binds it by number. Never the same port twice in one process."""
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(10_000, low) if low > 11_000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
