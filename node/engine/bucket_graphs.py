"""One CUDA graph per decode batch bucket, captured from the engine's step body, all in one pool.

`ensure(b)` captures bucket b if it has no graph yet: the body runs twice on a side stream (every
kernel compiled: Triton, DeepGEMM's JIT) and is then recorded. The caller must have pointed the
slot table at padding rows only, so the warm-up runs change no live sequence's state. A capture
that runs out of device memory is logged and that bucket is served eagerly from then on (slower,
never silent), so the node keeps serving.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)


class BucketGraphs:
    def __init__(self, device: torch.device, body: Callable[[int], torch.Tensor],
                 pad_all: Callable[[int], None]):
        self.device, self.body, self.pad_all = device, body, pad_all
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.eager: set[int] = set()
        """Buckets whose capture failed (out of memory): run eagerly."""
        self._pool = None

    def ensure(self, b: int) -> None:
        if b in self.graphs or b in self.eager:
            return
        self.pad_all(b)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.body(b)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.body(b)
        except torch.cuda.OutOfMemoryError as exc:
            self.eager.add(b)
            torch.cuda.empty_cache()
            log.error("CUDA graph capture of decode bucket %d ran out of memory (%s): serving it eagerly; "
                      "lower max_batch or max_seq_len to capture it", b, str(exc).splitlines()[0])
            return
        self.graphs[b], self.outputs[b] = graph, out

    def run(self, b: int) -> torch.Tensor:
        """Replay bucket b (after `ensure(b)`), or run it eagerly; returns the step's logits."""
        if b in self.eager:
            return self.body(b)
        self.graphs[b].replay()
        return self.outputs[b]

    def clear(self) -> None:
        """Drop every graph and their pool: the next `ensure` captures into a new pool (capturing again into a
        pool whose graphs were freed trips the caching allocator's assertion, seen on an H100, session 20)."""
        self.graphs.clear()
        self.outputs.clear()
        self.eager.clear()
        self._pool = None
