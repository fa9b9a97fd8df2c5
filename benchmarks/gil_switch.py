"""What the interpreter's switch interval costs a thread that waits outside the interpreter's lock, beside a thread
that runs Python: the inference role's engine thread beside its event loop. In the 0.52B network (session 42, one
H100) 0.5 ms gained nothing over Python's 5 ms, so the role keeps the default (`PRIMERL_SWITCH_INTERVAL_S` sets
another for an experiment; docs/scale.md "Session 42").

    python -m benchmarks.gil_switch [--steps 200] [--wait-ms 0.3] [--work-iters 2000] [--out FILE]

A stand-in step (named as such: no engine runs here): a wait that lets go of the lock (`time.sleep`, as a CUDA
synchronisation or launch does), then a little Python (the step's bookkeeping). Timed alone, then beside a thread
that runs Python without pause (a stand-in for the event loop proving, serialising and sending rollouts), at each
switch interval asked for. After each wait the step asks for the lock back, and gets it only when the other thread
is made to drop it, one switch interval later. Ends with one JSON line: the step's milliseconds alone and beside, per
interval, and the ratio of Python's default (5 ms) to each.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from benchmarks import emit


def stand_in_step(wait_s: float, work_iters: int) -> None:
    time.sleep(wait_s)
    s = 0
    for i in range(work_iters):
        s += i


def step_ms(steps: int, wait_s: float, work_iters: int, beside: bool) -> float:
    """Milliseconds a stand-in step takes, alone or beside a pure-Python busy thread."""
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            s = 0
            for i in range(10_000):
                s += i

    other = threading.Thread(target=busy, daemon=True) if beside else None
    if other is not None:
        other.start()
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            stand_in_step(wait_s, work_iters)
        return 1000 * (time.perf_counter() - t0) / steps
    finally:
        stop.set()
        if other is not None:
            other.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--wait-ms", type=float, default=0.3, help="the step's wait outside the lock")
    ap.add_argument("--work-iters", type=int, default=2000, help="the step's Python: loop iterations (~0.1 ms)")
    ap.add_argument("--intervals-ms", default="5,1,0.5,0.2", help="switch intervals to measure, comma-separated")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    default = sys.getswitchinterval()
    rows = {}
    try:
        for ms in (float(x) for x in args.intervals_ms.split(",")):
            sys.setswitchinterval(ms / 1000)
            rows[f"{ms:g}"] = {which: round(step_ms(args.steps, args.wait_ms / 1000, args.work_iters, beside), 3)
                               for which, beside in (("alone_ms", False), ("beside_python_ms", True))}
    finally:
        sys.setswitchinterval(default)
    base = rows.get("5", {}).get("beside_python_ms")
    for row in rows.values():
        row["default_over_this"] = round(base / row["beside_python_ms"], 2) if base else None
    return emit({"bench": "gil_switch", "steps": args.steps, "wait_ms": args.wait_ms, "work_iters": args.work_iters,
                 "by_switch_interval_ms": rows, "python": sys.version.split()[0]}, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
