"""The process heap of a long-running role: what it built to serve is set aside from the collector's full passes.

Imports nothing beyond the standard library, so the coordinator and the relay (which never import torch) use it.
"""

from __future__ import annotations

import gc
import time


def settle_heap() -> None:
    """Set what a role built to serve (its model's modules, its engine, the libraries it imported) aside from
    the garbage collector's full passes: collected once, then frozen. A full pass walks every object the
    process holds: ~0.12 s at the validator benchmark's ~300-380k objects (2-core CPU machine), landing in
    whichever judging round or engine step crosses the collector's threshold, and ~0 s after a freeze. Objects
    made later are collected as before."""
    gc.collect()
    gc.freeze()


class Collections:
    """Seconds the garbage collector ran, and its full (generation 2) passes, while `on`: a full pass scans the
    whole heap (~0.1 s at the validator benchmark's ~380k objects on the 2-core CPU machine) and lands in whichever
    round or step crosses its threshold, so a round's time holds it or not by the allocations before it. Counted
    in any thread of the process (a pass stops them all)."""

    def __init__(self, on: bool = False):
        self.on, self.seconds, self.full, self._t = on, 0.0, 0, 0.0
        gc.callbacks.append(self._phase)

    def _phase(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self._t = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._t
        self.full += info["generation"] == 2

    def close(self) -> None:
        """Counts no more (again: nothing)."""
        self.on = False
        if self._phase in gc.callbacks:
            gc.callbacks.remove(self._phase)
