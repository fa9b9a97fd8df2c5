"""The order channel of a world led by rank 0: what the trainer's world (`node.rl.parallel.world`) and
the expert-parallel inference world (`node.engine.ep_world`) share.

Rank 0 alone talks to the network; every other rank waits for its next order, scattered over a gloo
control group whatever the compute backend (orders are small Python objects, and their timeout
differs from the compute collectives'). Invariant: rank 0 sends an order or a keep-alive at least
every KEEPALIVE_S (`KeepAlive`), and a rank that hears nothing for ORDER_TIMEOUT_S raises
`LeaderLost`; so a dead rank 0 leaves no rank waiting for long, and a rank whose socket to rank 0
closes (rank 0 killed) raises at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

KEEPALIVE_S = 10.0
"""Rank 0 sends a keep-alive when it has sent no order for this long (waiting for a batch, warm-up)."""
ORDER_TIMEOUT_S = 120.0
"""A rank that hears nothing from rank 0 for this long (12 missed keep-alives) gives up."""


class LeaderLost(RuntimeError):
    """Rank 0 sent nothing (no order, no keep-alive) within ORDER_TIMEOUT_S, or its socket closed: it is gone."""


class ModelMismatch(ValueError):
    """Ranks were given different models (e.g. rank 0 resumed a checkpoint of another model than
    the run's): every rank raises it at start, naming the fields that differ."""


def control_group() -> dist.ProcessGroup:
    """The gloo group orders travel on (collective: every rank creates it, in the same order)."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=ORDER_TIMEOUT_S))


def exchange(group: dist.ProcessGroup, order: Any) -> Any:
    """Rank 0 sends `order` (one for all, or a list of one per rank); every rank receives its own."""
    rank = dist.get_rank()
    box: list = [None]
    orders = (order if isinstance(order, list) else [order] * dist.get_world_size()) if rank == 0 else None
    try:
        dist.scatter_object_list(box, orders, src=0, group=group)
    except RuntimeError as exc:
        if rank == 0:
            raise
        raise LeaderLost(f"rank {rank}: nothing from rank 0 within {ORDER_TIMEOUT_S:.0f}s ({exc})") from exc
    return box[0]


def check_same(group: dist.ProcessGroup, fields: dict) -> None:
    """Collective: raise `ModelMismatch` on every rank unless every rank passed the same `fields`."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, fields, group=group)
    for r, other in enumerate(everyone):
        diff = [f"{k}: rank 0 {v!r}, rank {r} {other.get(k)!r}" for k, v in everyone[0].items() if other.get(k) != v]
        if diff:
            raise ModelMismatch("ranks hold different models: " + "; ".join(diff))


class KeepAlive:
    """Calls `send()` (which queues a keep-alive order on rank 0's one collectives thread) whenever no
    order went out for KEEPALIVE_S; the sender calls `sent()` after every order."""

    def __init__(self, send: Callable[[], None], every_s: float = KEEPALIVE_S):
        self._send, self.every_s = send, every_s
        self._last = time.monotonic()
        self._closing = threading.Event()
        threading.Thread(target=self._run, name="keepalive", daemon=True).start()

    def sent(self) -> None:
        self._last = time.monotonic()

    def close(self) -> None:
        self._closing.set()

    def _run(self) -> None:
        while not self._closing.wait(self.every_s / 4):
            if time.monotonic() - self._last >= self.every_s:
                self._last = time.monotonic()  # one queued keep-alive at a time
                try:
                    self._send()
                except RuntimeError:  # the executor was shut down meanwhile (stopping)
                    return
