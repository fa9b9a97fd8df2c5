"""An engine step's phases timed on the wall and on its thread's CPU (`EngineCore.phases`): in the inference role's
activity rows (`phases`), where the wall minus the CPU is what a phase waited for the interpreter's lock, a sleeping
call or a core."""

from __future__ import annotations

import time


class PhaseClock:
    """Wall and CPU seconds of one thread's named phases (an engine step's swap, prefill, decode, finish), summed until
    `take`. Wall minus CPU is what the phase waited: for the interpreter's lock, on a sleeping call (a pageable copy, a
    lock), or for a core; a phase nested in another counts in both."""

    def __init__(self) -> None:
        self._sums: dict[str, list[float]] = {}

    def __call__(self, name: str) -> "_Phase":
        return _Phase(self._sums.setdefault(name, [0.0, 0.0, 0]))

    def take(self) -> dict[str, list[float]]:
        """{phase: [wall_s, cpu_s, times]} since the last take."""
        sums, self._sums = self._sums, {}
        return {k: [round(v[0], 5), round(v[1], 5), v[2]] for k, v in sums.items()}


class _Phase:
    __slots__ = ("acc", "t", "c")

    def __init__(self, acc: list) -> None:
        self.acc = acc

    def __enter__(self) -> None:
        self.t, self.c = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc) -> None:
        self.acc[0] += time.perf_counter() - self.t
        self.acc[1] += time.thread_time() - self.c
        self.acc[2] += 1
