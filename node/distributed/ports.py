"""Free local ports: a world's rendezvous (node/engine/ep_spawn.py), the roles of a local run (node/sim.py).
Torch-free: the sim's own process never imports torch."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (another process may take it before it is bound again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
