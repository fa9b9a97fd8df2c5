"""Where a process's CPU goes, thread by thread: each thread's seconds on a core and seconds it was ready to run but
waited for one (Linux `/proc/self/task/TID/schedstat`), summed by thread family.

A role process runs several threads under one interpreter lock: the inference role's engine thread steps the
engine while the event loop, libp2p's trio thread, proof builders and the weight path's staging threads run
beside it. A thread waiting for the lock sleeps (it is neither on a core nor ready to run), so over a window
`wall - cpu - runq` of a thread that never idles is its wait for the lock (or the GPU's callbacks), and the other
threads' `cpu` says who held it. CUDA synchronisations spin: a thread waiting on the GPU counts as on a core.

Families: a Python thread's name without its counter (`asyncio_3` -> `asyncio`, `ThreadPoolExecutor-2_5` ->
`ThreadPoolExecutor-2`); a thread Python did not start, by its kernel name (`comm`)."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

TASKS = Path("/proc/self/task")
_COUNTER = re.compile(r"(_\d+|-\d+)$")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def family(name: str) -> str:
    """A thread name without its trailing counter (`asyncio_3` -> `asyncio`, `Thread-7 (run)` stays)."""
    return _COUNTER.sub("", name) or name


def _read(tid: str) -> tuple[float, float | None] | None:
    """(seconds on a core, seconds ready but waiting for one) of one thread; None once it has ended. Without
    schedstat (a kernel built without it), the on-core seconds from `stat` at the clock tick and no wait."""
    try:
        on_cpu, waiting, _ = (TASKS / tid / "schedstat").read_text().split()
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    except FileNotFoundError:
        if not (TASKS / tid).exists():
            return None
    except (OSError, ValueError):
        pass
    try:
        fields = (TASKS / tid / "stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * _TICK_S, None  # utime + stime (fields 14 and 15 of stat)
    except (OSError, ValueError, IndexError):
        return None


class ThreadClock:
    """Per-thread-family CPU and run-queue seconds since the last `lap` (or since it was made)."""

    def __init__(self) -> None:
        self.available = TASKS.is_dir()
        self._comm: dict[str, str] = {}
        self._last: dict[str, tuple[float, float | None]] = self._snapshot() if self.available else {}
        self._t = time.monotonic()

    def _snapshot(self) -> dict[str, tuple[float, float | None]]:
        out = {}
        for entry in os.scandir(TASKS):
            got = _read(entry.name)
            if got is not None:
                out[entry.name] = got
        return out

    def _names(self, tids) -> dict[str, str]:
        """Python's names for its threads; the kernel's (read once per thread) for the others."""
        names = {str(t.native_id): family(t.name) for t in threading.enumerate() if t.native_id is not None}
        for tid in tids:
            if tid not in names:
                if tid not in self._comm:
                    try:
                        self._comm[tid] = family((TASKS / tid / "comm").read_text().strip()) or "?"
                    except OSError:
                        self._comm[tid] = "?"
                names[tid] = self._comm[tid]
        return names

    def lap(self) -> dict:
        """{"wall_s", "families": {family: {"cpu_s", "runq_s", "threads"}}} since the last lap: threads that ended
        in between are left out (their last seconds are lost), a thread that began counts from zero. Empty
        where /proc is absent."""
        if not self.available:
            return {}
        t = time.monotonic()
        now = self._snapshot()
        names = self._names(now)
        self._comm = {tid: n for tid, n in self._comm.items() if tid in now}
        out: dict[str, dict[str, float]] = {}
        for tid, (cpu, runq) in now.items():
            cpu0, runq0 = self._last.get(tid, (0.0, 0.0 if runq is not None else None))
            row = out.setdefault(names.get(tid, "?"), {"cpu_s": 0.0, "runq_s": 0.0, "threads": 0})
            row["cpu_s"] += max(0.0, cpu - cpu0)
            if runq is not None and runq0 is not None:
                row["runq_s"] += max(0.0, runq - runq0)
            row["threads"] += 1
        self._last, wall, self._t = now, t - self._t, t
        return {"wall_s": round(wall, 4),
                "families": {k: {"cpu_s": round(v["cpu_s"], 4), "runq_s": round(v["runq_s"], 4), "threads": v["threads"]}
                             for k, v in sorted(out.items())}}


def merged(a: dict | None, b: dict) -> dict:
    """Two laps as one (their walls and each family's seconds added; a family's thread count the larger)."""
    if not a:
        return b
    families = {k: dict(v) for k, v in a["families"].items()}
    for k, v in b["families"].items():
        f = families.setdefault(k, {"cpu_s": 0.0, "runq_s": 0.0, "threads": 0})
        f["cpu_s"] = round(f["cpu_s"] + v["cpu_s"], 4)
        f["runq_s"] = round(f["runq_s"] + v["runq_s"], 4)
        f["threads"] = max(f["threads"], v["threads"])
    return {"wall_s": round(a["wall_s"] + b["wall_s"], 4), "families": dict(sorted(families.items()))}


class ThreadMonitor:
    """A daemon thread that laps a `ThreadClock` every `period_s` and adds the laps up until `take`. Its own
    thread, not the measured one's: each /proc read releases and takes the interpreter lock again, and on a busy
    interpreter each take can wait a switch interval (~40 reads a lap). Laps shorter than the taker's period
    give each take at least one."""

    def __init__(self, period_s: float = 0.25) -> None:
        self.period_s = period_s
        self._latest: dict | None = None
        self._handing = threading.Lock()
        self.lapped = threading.Event()
        """Set at the first lap (a caller may wait for one)."""
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="thread-clock", daemon=True)

    def start(self) -> "ThreadMonitor":
        self._thread.start()
        return self

    def _run(self) -> None:
        clock = ThreadClock()
        if not clock.available:
            return
        while not self._halt.wait(self.period_s):
            lap = clock.lap()
            with self._handing:
                self._latest = merged(self._latest, lap)
            self.lapped.set()

    def take(self) -> dict | None:
        """The laps since the last take, added up (None: none ended since)."""
        with self._handing:
            lap, self._latest = self._latest, None
        return lap

    def stop(self) -> None:
        self._halt.set()
