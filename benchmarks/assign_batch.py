"""Batch assignment cost against the size of the coordinator's history: one trainer poll
(`pipeline.assign_batch`) on a real SQLite file holding 10k / 100k accepted rollouts.

    python -m benchmarks.assign_batch [--sizes 10000,100000] [--waiting 256] [--batch 64] [--repeats 5]

State: `--sizes` accepted units, all but `--waiting` of them already batched (64 per step, the
history of a long run), the waiting ones of the newest admissible versions with a mix of valid,
invalid and missing verdicts, plus a few stale ones and one banned submitter's. Each repeat copies
the same file and builds the next step's batch from scratch. The peer in the same run is the
previous implementation (kept here: it read every accepted row and every verdict on each poll),
run on identical copies; the two must pick the same units and drop the same ones. Also timed: the
lease throttle's `work_out` (called on every lease grant). Prints progress, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from protocol import pipeline
from protocol.coordinator import Coordinator
from protocol.identity import NodeKey
from protocol.messages import RunSpec

log = logging.getLogger("bench.assign_batch")
PER_STEP = 64


def assign_batch_full_scan(state: Coordinator, step: int, size: int, selector) -> list[int]:
    """The implementation before this benchmark (the peer): every accepted row and every verdict read."""
    assigned = state.store.batch_of(step)
    if len(assigned) >= size:
        return assigned[:size]
    banned = state.store.banned_peers()
    valid = state.store.verdicts()
    with state.store as db:
        for rec in sorted(state.store.accepted(), key=lambda r: (r.min_version, r.work_id)):  # oldest version first
            if len(assigned) >= size:
                break
            if rec.batch_step is not None or rec.dropped is not None:
                continue
            reason = ("stale" if not state.ledger.admissible(rec.min_version, step)
                      else "banned" if rec.submitter in banned else None)
            if reason:
                db.drop([rec.work_id], reason)
                continue
            if (rec.probation or selector(rec.work_id)) and not valid.get(rec.work_id, False):
                continue
            db.assign(rec.work_id, step)
            db.credit(rec.submitter)
            assigned.append(rec.work_id)
    return sorted(assigned)


def build(directory: Path, total: int, waiting: int) -> tuple[RunSpec, int]:
    """A coordinator state with `total` accepted units; returns (spec, the next step)."""
    spec = RunSpec(run_id="assign-bench", coordinator=NodeKey.generate().peer_id, max_off_policy_steps=2,
                   heartbeat_interval_s=60, lease_ttl_s=600, batch_groups=PER_STEP)
    c = Coordinator(directory, spec, synchronous="OFF", retain_versions=10**9)
    peers = [NodeKey.generate().peer_id for _ in range(8)]
    batched = total - waiting
    steps = (batched + PER_STEP - 1) // PER_STEP
    current = steps + 1  # waiting units were made by the last versions
    c.ledger.advance(current)
    with c.store as db:
        db.add_policy_version(current, "00" * 32, 0.0)
        for w in range(total):
            peer = peers[w % len(peers)]
            if w < batched:
                version = w // PER_STEP
            else:  # the waiting ones: mostly admissible, a few stale
                version = current - (w % 3) if w % 50 else current - 5
            db.mint_work(version, w % 1000, w, peer, 1e12)
            db.insert_accepted(w, peer, "ab" * 32, version, 32, 1.0, ("seg-00000000", 100 * w, 100), float(w),
                               probation=w >= batched and w % 7 == 0)
            if w < batched:
                db.put_verdict(w, True, "v", "", float(w))
                db.assign(w, w // PER_STEP)
            elif w % 4:  # a quarter of the waiting ones have no verdict yet
                db.put_verdict(w, w % 9 != 0, "v", "" if w % 9 else "invalid", float(w))
        db.put_ban(peers[-1], "bench", None, 0.0)
    c.close()
    return spec, current + 1


def timed(directory: Path, spec: RunSpec, step: int, batch: int, fn) -> tuple[float, list[int], dict]:
    c = Coordinator(directory, spec, synchronous="OFF", retain_versions=10**9)
    t = time.perf_counter()
    ids = fn(c, step, batch, lambda w: w % 2 == 0)
    dt = time.perf_counter() - t
    dropped = {r.work_id: r.dropped for r in c.store.accepted() if r.dropped}
    c.close()
    return dt, ids, dropped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000", help="accepted units in the store, comma-separated")
    ap.add_argument("--waiting", type=int, default=256, help="accepted units not yet batched")
    ap.add_argument("--batch", type=int, default=PER_STEP, help="units the step's batch takes")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("protocol").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="assign-bench-") as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            base = Path(tmp) / f"base-{size}"
            spec, step = build(base, size, args.waiting)
            times: dict[str, list[float]] = {"indexed": [], "full_scan": []}
            results = {}
            for r in range(args.repeats):
                for name, fn in (("indexed", pipeline.assign_batch), ("full_scan", assign_batch_full_scan)):
                    copy = Path(tmp) / f"{name}-{size}-{r}"
                    shutil.copytree(base, copy)
                    dt, ids, dropped = timed(copy, spec, step, args.batch, fn)
                    times[name].append(dt)
                    results[name] = (ids, dropped)
                    shutil.rmtree(copy)
            if results["indexed"] != results["full_scan"]:
                raise SystemExit(f"the two implementations disagree at {size} rows")
            c = Coordinator(base, spec, synchronous="OFF", retain_versions=10**9)
            t = time.perf_counter()
            for _ in range(100):
                pipeline.work_out(c)
            work_out_ms = (time.perf_counter() - t) * 10
            c.close()
            med = {k: statistics.median(v) * 1000 for k, v in times.items()}
            out[str(size)] = {"assign_ms_indexed": round(med["indexed"], 3), "assign_ms_full_scan":
                              round(med["full_scan"], 3), "speedup": round(med["full_scan"] / med["indexed"], 1),
                              "batch_filled": len(results["indexed"][0]), "dropped": len(results["indexed"][1]),
                              "work_out_ms": round(work_out_ms, 3), "same_result": True}
            log.info("%d accepted rows: %s", size, out[str(size)])
    result = {"bench": "assign_batch", "machine": platform.node(), "python": sys.version.split()[0],
              "command": "python -m benchmarks.assign_batch " + " ".join(argv if argv is not None else sys.argv[1:]),
              "waiting": args.waiting, "batch": args.batch, "repeats": args.repeats,
              "seconds": round(time.perf_counter() - t0, 1), "by_accepted_rows": out}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
