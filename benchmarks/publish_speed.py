"""How long the trainer's publication of one version takes, by stage, against the host's memory bandwidth
(issue 24's weight path: the 5.2B model's 10 GB bf16 versions took 4.3-7.8 s to publish as deltas).

    python -m benchmarks.publish_speed [--gib 2] [--changed 0.05] [--versions 3] [--store DIR] [--threads N] [--scaling]

What it times is `shardcast.publish.publish_stream`, the call the trainer role makes
(node/rl/parallel/publish.py) once its weights are in the payload buffer, to the version listed beside the
publisher (`listed_s`: what the coordinator announces then; processes sharing the store read it) and to the
whole version (`seconds`: wire shards encoded, what peers elsewhere fetch): a full version 0, then
`--versions` deltas, each changing `--changed` of the bf16 words at random (an RL step in bf16 changes
few: the 5.2B run's deltas were 1-7% of the bytes on the wire), into a real `Store` at `--store`. The
limits measured in the same run: one copy of the payload in memory (numpy, one thread), and BLAKE3 over it
(the raw hashes every publication computes). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from protocol.identity import NodeKey
from shardcast.codec import layout
from shardcast.hashing import content_hash
from shardcast.publish import PublishOptions, publish_stream
from shardcast.store import Store

from benchmarks import emit

log = logging.getLogger("benchmarks.publish_speed")


def _tensors(total: int, tensor_bytes: int = 64 << 20):
    """A layout of bf16 tensors of `tensor_bytes` each, `total` bytes in all (a model's payload)."""
    import torch

    n = max(1, total // tensor_bytes)
    meta = {f"t{i}": torch.empty(tensor_bytes // 2, dtype=torch.bfloat16, device="meta") for i in range(n)}
    return layout(meta)[0]


def run(args: argparse.Namespace) -> dict:
    total = int(args.gib * (1 << 30))
    tensors = _tensors(total)
    total = tensors[-1].offset + tensors[-1].nbytes
    rng = np.random.default_rng(0)
    payload = np.empty(total, dtype=np.uint8)
    payload.view(np.uint64)[:] = rng.integers(0, 1 << 63, size=total // 8, dtype=np.int64).view(np.uint64)
    root = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="publish-speed-"))
    key = NodeKey.generate()
    copy = np.empty_like(payload)
    np.copyto(copy, payload)  # its pages touched: the copy below runs at memory speed
    t = time.perf_counter()
    np.copyto(copy, payload)
    copy_s = time.perf_counter() - t
    del copy
    t = time.perf_counter()
    content_hash(memoryview(payload))
    hash_s = time.perf_counter() - t
    rows = []
    words = payload.view(np.uint16)
    # the words every delta changes, drawn once with replacement (the share is a little under --changed): a draw
    # per version over 5e9 words took longer than the publications on the H200 host
    at = rng.integers(0, len(words), size=int(args.changed * len(words)))
    store = Store(root / "shardcast")
    opt = PublishOptions(threads=args.threads or PublishOptions().threads)
    try:
        for v in range(args.versions + 1):
            if v:
                words[at] ^= rng.integers(1, 8, size=len(at), dtype=np.uint16)  # low mantissa bits: a bf16 step
            t, listed = time.perf_counter(), []
            signed = publish_stream(store, key, "bench", v, tensors, payload, iter([total]), v - 1 if v else None, opt,
                                    on_signed=lambda _: listed.append(time.perf_counter() - t))
            m = signed.manifest
            rows.append({"version": v, "encoding": m.encoding, "listed_s": round(listed[0], 3),
                         "seconds": round(time.perf_counter() - t, 3), "wire_mib": round(m.wire_bytes / 2**20, 1)})
            log.info("%s", rows[-1])
    finally:
        if not args.store:
            shutil.rmtree(root, ignore_errors=True)
    deltas = [r["seconds"] for r in rows if r["encoding"] == "delta"]
    listed = [r["listed_s"] for r in rows if r["encoding"] == "delta"]
    return {"bench": "publish_speed", "command": "python -m benchmarks.publish_speed " + " ".join(sys.argv[1:]),
            "host_cores": os.cpu_count(), "threads": opt.threads, "payload_gib": round(total / 2**30, 3),
            "changed": args.changed, "store": str(root), "versions": rows,
            "delta_listed_s_median": float(np.median(listed)) if listed else None,
            "delta_publish_s_median": float(np.median(deltas)) if deltas else None,
            "delta_publish_gb_s": round(total / 1e9 / float(np.median(deltas)), 3) if deltas else None,
            "copy_gb_s_one_thread": round(total / 1e9 / copy_s, 3), "blake3_gb_s_one_thread": round(total / 1e9 / hash_s, 3),
            "delta_over_one_copy": round(float(np.median(deltas)) / copy_s, 2) if deltas else None}


def scaling(args: argparse.Namespace) -> dict:
    """What limits the pool: delta shards encoded (`codec.encode_shard`, 64 MiB, `--changed` of the words) and
    raw shards written with `os.pwrite`, into one file (as `publish_stream` writes the payload) and into a file
    per thread, at 1, 2, 4, ... threads; seconds per shard of thread time and of wall time."""
    from concurrent.futures import ThreadPoolExecutor

    from shardcast.codec import DEFAULT_SHARD_SIZE, encode_shard

    n, shards = DEFAULT_SHARD_SIZE, 24
    rng = np.random.default_rng(1)
    parent = rng.integers(0, 255, n, dtype=np.uint8)
    raws = []
    for _ in range(4):
        raw = parent.copy()
        w = raw.view(np.uint16)
        at = rng.integers(0, len(w), size=int(args.changed * len(w)))
        w[at] ^= rng.integers(1, 8, size=len(at), dtype=np.uint16)
        raws.append(raw)
    root = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="publish-scaling-"))
    root.mkdir(parents=True, exist_ok=True)
    out: dict = {"shard_mib": n >> 20, "shards": shards, "encode": {}, "pwrite_one_file": {}, "pwrite_own_files": {}}

    def timed(fn, i):
        t = time.perf_counter()
        fn(i)
        return time.perf_counter() - t

    threads = [t for t in (1, 2, 4, 8, 12, 16) if t <= max(2, os.cpu_count() or 2)]
    try:
        for th in threads:
            with ThreadPoolExecutor(th) as pool:
                list(pool.map(lambda i: encode_shard(i, raws[i % 4], parent, word=2), range(th)))  # scratch warm
                t = time.perf_counter()
                busy = list(pool.map(lambda i: timed(lambda j: encode_shard(j, raws[j % 4], parent, word=2), i), range(shards)))
                out["encode"][th] = {"wall_s_per_shard": round((time.perf_counter() - t) / shards, 4),
                                     "thread_s_per_shard": round(sum(busy) / shards, 4)}
            for kind in ("pwrite_one_file", "pwrite_own_files"):
                files = [root / f"scaling-{kind}-{i}.bin" for i in range(1 if kind == "pwrite_one_file" else th)]
                fds = [os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for f in files]

                def write(i):
                    fd = fds[i % len(fds)]
                    view, at = memoryview(raws[i % 4]), (i if len(fds) == 1 else i // len(fds)) * n
                    while len(view):
                        k = os.pwrite(fd, view, at)
                        view, at = view[k:], at + k

                with ThreadPoolExecutor(th) as pool:
                    t = time.perf_counter()
                    busy = list(pool.map(lambda i: timed(write, i), range(shards)))
                    wall = time.perf_counter() - t
                for fd, f in zip(fds, files):
                    os.close(fd)
                    f.unlink()
                out[kind][th] = {"wall_s_per_shard": round(wall / shards, 4), "thread_s_per_shard": round(sum(busy) / shards, 4),
                                 "gb_s": round(shards * n / 1e9 / wall, 2)}
            log.info("threads %d: encode %s, pwrite one file %s, own files %s", th, out["encode"][th],
                     out["pwrite_one_file"][th], out["pwrite_own_files"][th])
    finally:
        if not args.store:
            shutil.rmtree(root, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="payload size (the 5.2B model's bf16 version: 9.66)")
    ap.add_argument("--changed", type=float, default=0.05, help="share of bf16 words a delta changes")
    ap.add_argument("--versions", type=int, default=3, help="deltas after the full version 0")
    ap.add_argument("--store", default=None, help="store root (default: a temporary directory, deleted after)")
    ap.add_argument("--threads", type=int, default=0, help="publication threads (default: PublishOptions')")
    ap.add_argument("--scaling", action="store_true",
                    help="also time delta-shard encoding and payload writes at 1, 2, 4, ... threads (`scaling`)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    result = run(args)
    if args.scaling:
        result["scaling"] = scaling(args)
    return emit(result, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
