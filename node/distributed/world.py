"""Joining and leaving a torch.distributed world, for the trainer's ranks (node/rl/parallel) and the
expert-parallel inference ranks (node/engine/ep_world.py) alike: neither imports the other.

Invariant: no rank closes its sockets while a peer may still be mid-collective (`shutdown_distributed`).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


class LayoutError(ValueError):
    """A parallel layout that does not fit the world or the model (raised at start-up, before
    any weights move; the message names the dimension and the numbers that do not divide)."""


def shutdown_distributed(timeout_s: float = 60.0) -> None:
    """Leave the world without aborting a peer. A gloo collective can return on one rank while
    another still reads its last message; closing the sockets then makes gloo abort that rank
    ("terminate called without an active exception": seen in CI, about 1 run in 2 of the 2-rank EP
    engine test, with barrier + destroy). So every rank checks in through the rendezvous store once
    its last collective has returned, and no rank closes its sockets before all have (or
    `timeout_s` passed: a dead peer; or the store's host left: nobody is mid-collective then)."""
    if not dist.is_initialized():
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        store.add(_SHUTDOWN_KEY, 1)
        deadline = time.monotonic() + timeout_s
        while store.add(_SHUTDOWN_KEY, 0) < dist.get_world_size() and time.monotonic() < deadline:
            time.sleep(0.01)
    except (RuntimeError, ValueError):
        pass
    dist.destroy_process_group()


_SHUTDOWN_KEY = "primerl/shutdown"


def init_distributed(timeout_s: float | None = None) -> str:
    """Join the torchrun world (env:// rendezvous): NCCL with one GPU per local rank, else gloo.
    `timeout_s` bounds every collective wait (None: torch's default, 30 min on gloo).
    Returns the device type."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend, device = "nccl", "cuda"
    else:
        backend, device = "gloo", "cpu"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=None if timeout_s is None else timedelta(seconds=timeout_s))
    return device
