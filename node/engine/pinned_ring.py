"""Pinned host buffers through which tensors go to a GPU, several host copies at a time: a policy version's
tensors from its payload's mapping (node/engine/weight_staging.py) and the validator's versions
(node/roles/resident_policy.py).

Invariant: a buffer is refilled only once the device copy of its last piece has left it (a CUDA event), and
a caller may read a destination on its stream only after `settle` (every piece queued on that stream).
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

CHUNK_BYTES = 64 << 20
"""Pinned buffer size: one shardcast shard; large tensors go through in pieces of this size."""
HOST_THREADS = 4
"""Host copies in flight (the ring holds twice as many pinned buffers): one thread copied 10 GB of
payload pages into pinned memory at ~4.5 GB/s (stage_s 2.2-3.0 s on the H200 host, session 7)."""


class RingSeconds(NamedTuple):
    """Where settled pieces spent their time, summed over the ring's threads (they overlap: seconds of work,
    not of wall). `host_s`: copying payload pages into pinned buffers, of which `host_cpu_s` the thread ran
    (the copy and its page faults; the rest it waited for a core or for the interpreter's lock to come back);
    `wait_s`: waiting for a buffer's previous piece to leave for the device (the copies to the GPU behind)."""

    host_s: float = 0.0
    host_cpu_s: float = 0.0
    wait_s: float = 0.0

    def __add__(self, other: tuple) -> RingSeconds:  # type: ignore[override]
        return RingSeconds(*(a + b for a, b in zip(self, other)))


class PinnedRing:
    """Pinned host buffers of `CHUNK_BYTES` (twice `HOST_THREADS` of them), reused for every version an
    engine receives, filled by `HOST_THREADS` threads: each takes a free buffer, copies one piece of a tensor into it (payload pages ->
    pinned: the one host copy, which torch runs on one core in a role, OMP_NUM_THREADS=1) and sends it on
    to the device asynchronously on the caller's stream. So host copies run several at a time while earlier
    pieces travel to the device; a buffer is refilled only once its last piece has left."""

    def __init__(self, device: torch.device, threads: int | None = None):
        if device.index is None:  # "cuda": the current device (a thread's set_device needs an index)
            device = torch.device("cuda", torch.cuda.current_device())
        self.threads = threads or HOST_THREADS
        self.bufs = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2 * self.threads)]
        self.done: list[torch.cuda.Event | None] = [None] * len(self.bufs)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for k in range(len(self.bufs)):
            self._free.put(k)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="pinned-ring",
                                        initializer=torch.cuda.set_device, initargs=(device,))
        # the role's thread may stage a version while the engine's applies the previous one directly:
        # buffers are shared, each caller waits only for its own pieces

    def copy(self, src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream) -> list[Future]:
        """dst (device, contiguous) <- src (host, same dtype and size), piece by piece, asynchronously on
        `stream`. The pieces are queued for the ring's threads: wait for the returned futures before the
        stream's later work may read dst (`settle`)."""
        s, d = src.contiguous().reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8)
        modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())  # thread-local: the caller's go along
        return [self._pool.submit(self._piece, s[at : at + CHUNK_BYTES], d[at : at + CHUNK_BYTES], stream, modes)
                for at in range(0, s.numel(), CHUNK_BYTES)]

    def _piece(self, s: torch.Tensor, d: torch.Tensor, stream: torch.cuda.Stream,
               modes: tuple[bool, bool]) -> RingSeconds:
        k = self._free.get()
        try:
            with torch.inference_mode(modes[0]), torch.set_grad_enabled(modes[1]):
                return self._send(k, s, d, stream)
        finally:
            self._free.put(k)

    def _send(self, k: int, s: torch.Tensor, d: torch.Tensor, stream: torch.cuda.Stream) -> RingSeconds:
        t0 = time.perf_counter()
        if self.done[k] is not None:
            self.done[k].synchronize()  # its last piece has left for the device
        t1, c1 = time.perf_counter(), time.thread_time()
        n = s.numel()
        self.bufs[k][:n].copy_(s)
        t2, c2 = time.perf_counter(), time.thread_time()
        with torch.cuda.stream(stream):
            d.copy_(self.bufs[k][:n], non_blocking=True)
            self.done[k] = torch.cuda.Event()
            self.done[k].record(stream)
        return RingSeconds(t2 - t1, c2 - c1, t1 - t0)


def settle(pieces: list[Future]) -> RingSeconds:
    """Wait until every queued piece is on its stream (raises what a piece raised); their seconds summed."""
    spent = RingSeconds()
    for f in pieces:
        spent += f.result()
    pieces.clear()
    return spent
