"""Pinned host buffers through which tensors go to a GPU, several host copies at a time: a policy version's
tensors from its payload's mapping (node/engine/weight_staging.py) and the validator's versions
(node/roles/resident_policy.py).

Invariant: a buffer is refilled only once the device copy of its last piece has left it (a CUDA event), and
a caller may read a destination on its stream only after `settle` (every piece queued on that stream).
"""

from __future__ import annotations

import os
import queue
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

CHUNK_BYTES = 64 << 20
"""Pinned buffer size: one shardcast shard; large tensors go through in pieces of this size."""
HOST_THREADS = min(8, max(2, len(os.sched_getaffinity(0)) // 2))
"""Host copies in flight (the ring holds twice as many pinned buffers): half the cores this process may run on,
2 to 8. One thread copies payload pages into pinned memory at ~4-5 GB/s, so the copies bound staging: a 10.4 GB
version staged whole (`benchmarks.stage_speed --paths mirror`, the H200 host's 16 cores, session 35) in 0.746 s
with 4 threads and 0.408 s with 8 (13.9 -> 25.4 GB/s; pinned H2D 52.8-55.4 GB/s); beside 12 busy wire
threads 0.906 -> 0.711 s."""


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
        self.device = device
        self.dev_bufs: list[torch.Tensor] | None = None
        """Device buffers, one beside each pinned one, made at the first `copy_many` (runs land there first)."""
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

    def copy_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: torch.cuda.Stream) -> list[Future]:
        """dst <- src for each (host src, device dst) pair, as `copy` does one, in runs: contiguous sources that view
        one host storage (a payload's tensors are dtype views of slices of its mapping: `shardcast.codec.unflatten`)
        go through the ring in runs of up to `CHUNK_BYTES` of it (`runs`). A run is one host copy into a pinned
        buffer, one copy to the device buffer beside it and one batched device-to-device copy into every
        destination it holds (`torch._foreach_copy_`): a handful of calls a run, where `copy` makes several a
        tensor. A 5.2B version's ~3,100 tensors (each expert its own, 3 MB) are ~160 runs. In the network every
        call of a ring thread waits for the interpreter's lock beside the engine's thread, and a version was staged
        in the same ~2.0 s whether it was 10.4 GB (bf16) or 4.4 GB (FP8 served form; session 32). A pair whose
        source or destination is not contiguous goes through `copy`. Settle the returned pieces as `copy`'s."""
        pieces: list[Future] = []
        by_root: dict[int, tuple[torch.Tensor, list[tuple[int, int]], list[torch.Tensor]]] = {}
        for src, dst in pairs:
            if (src.device.type != "cpu" or not src.is_contiguous() or not dst.is_contiguous()
                    or src.numel() * src.element_size() != dst.numel() * dst.element_size()):
                pieces += self.copy(src, dst, stream)
                continue
            storage = src.untyped_storage()  # a payload's tensors share their mapping's
            root, spans, dsts = by_root.get(storage.data_ptr()) or by_root.setdefault(
                storage.data_ptr(), (torch.empty(0, dtype=torch.uint8).set_(storage), [], []))
            spans.append((src.data_ptr() - root.data_ptr(), src.numel() * src.element_size()))
            dsts.append(dst.reshape(-1).view(torch.uint8))
        if by_root and self.dev_bufs is None:
            self.dev_bufs = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, device=self.device) for _ in self.bufs]
        modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        for root, spans, dsts in by_root.values():
            for lo, hi, segments in runs(spans, CHUNK_BYTES):
                parts = [(dsts[j][at : at + n], offset, n) for j, at, offset, n in segments]
                pieces.append(self._pool.submit(self._run, root[lo:hi], parts, stream, modes))
        return pieces

    def _run(self, s: torch.Tensor, parts: list[tuple[torch.Tensor, int, int]], stream: torch.cuda.Stream,
             modes: tuple[bool, bool]) -> RingSeconds:
        k = self._free.get()
        try:
            with torch.inference_mode(modes[0]), torch.set_grad_enabled(modes[1]):
                spent = self._send(k, s, self.dev_bufs[k][: s.numel()], stream, parts)
        finally:
            self._free.put(k)
        return spent

    def _piece(self, s: torch.Tensor, d: torch.Tensor, stream: torch.cuda.Stream,
               modes: tuple[bool, bool]) -> RingSeconds:
        k = self._free.get()
        try:
            with torch.inference_mode(modes[0]), torch.set_grad_enabled(modes[1]):
                return self._send(k, s, d, stream)
        finally:
            self._free.put(k)

    def _send(self, k: int, s: torch.Tensor, d: torch.Tensor, stream: torch.cuda.Stream,
              parts: list[tuple[torch.Tensor, int, int]] | None = None) -> RingSeconds:
        """s -> pinned buffer k -> d on `stream` (then, for a run, d's `parts` into their destinations); the
        buffer's event follows the last copy that reads it (a run's device buffer k too)."""
        t0 = time.perf_counter()
        if self.done[k] is not None:
            self.done[k].synchronize()  # its last piece has left for the device
        t1, c1 = time.perf_counter(), time.thread_time()
        n = s.numel()
        self.bufs[k][:n].copy_(s)
        t2, c2 = time.perf_counter(), time.thread_time()
        with torch.cuda.stream(stream):
            d.copy_(self.bufs[k][:n], non_blocking=True)
            if parts:
                torch._foreach_copy_([dst for dst, _, _ in parts], [d[at : at + m] for _, at, m in parts])
            self.done[k] = torch.cuda.Event()
            self.done[k].record(stream)
        return RingSeconds(t2 - t1, c2 - c1, t1 - t0)


def shares_storage(src: torch.Tensor) -> bool:
    """Whether `src` is a contiguous view into a larger host storage (a payload's mapping, a checkpoint file's), which
    `PinnedRing.copy_many` sends in runs once every tensor is given. A tensor of its own (one a checkpoint reader cast
    or dequantised at lookup) is better copied at once: gathering those first would hold the whole version on the
    host."""
    return (src.device.type == "cpu" and src.is_contiguous()
            and src.untyped_storage().nbytes() > src.numel() * src.element_size())


def runs(spans: list[tuple[int, int]], chunk: int,
         gap: int = 1 << 20) -> list[tuple[int, int, list[tuple[int, int, int, int]]]]:
    """Byte ranges of one host storage (`spans[j]`: start, length) gathered into runs to copy whole: (lo, hi,
    segments) with hi - lo <= `chunk`, each segment (j, at, offset, n): bytes at..at + n of span j lie at
    offset..offset + n of the run. Spans are taken in address order; one longer than what is left of a run goes on
    in the next; a run also takes the bytes between two spans up to `gap` of them (a payload's tensors lie back to
    back, 64-byte aligned). Every byte of every span is in exactly one segment."""
    out: list[tuple[int, int, list[tuple[int, int, int, int]]]] = []
    lo = hi = 0
    segments: list[tuple[int, int, int, int]] = []
    for j in sorted(range(len(spans)), key=lambda i: spans[i][0]):
        start, length = spans[j]
        at = 0
        while at < length:
            a = start + at
            if not segments or a - hi > gap or a >= lo + chunk:
                if segments:
                    out.append((lo, hi, segments))
                lo = hi = a
                segments = []
            n = min(length - at, lo + chunk - a)
            segments.append((j, at, a - lo, n))
            hi = max(hi, a + n)
            at += n
    if segments:
        out.append((lo, hi, segments))
    return out


def settle(pieces: list[Future]) -> RingSeconds:
    """Wait until every queued piece is on its stream (raises what a piece raised); their seconds summed."""
    spent = RingSeconds()
    for f in pieces:
        spent += f.result()
    pieces.clear()
    return spent
