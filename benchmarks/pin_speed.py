"""How long a checkpoint's version-0 hash takes (`node.model.fill.checkpoint_digest`: what `primerl-node model pin`
prints and what a trainer's rank 0 checks before it starts from a pinned checkpoint), one thread against several:

    python -m benchmarks.pin_speed [--shape qwen3-30b-a3b-2l] [--dir /tmp/pin] [--threads 2] [--repeats 2]

A random checkpoint of `--shape` is written twice (bf16, and block-scaled FP8 `all`, the layout Qwen3 publishes,
whose weights are dequantised to be hashed), then hashed in bf16 with 1 and with `--threads` threads, alternating,
each after one unmeasured pass (so every pass reads from the page cache). The hashes must agree. Ends with one
JSON line (seconds per pass, the speedup, GB hashed per second).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import emit


def main(argv: list[str] | None = None) -> int:
    from benchmarks.random_checkpoint import SHAPES, write_random
    from node.model.fill import checkpoint_digest
    from node.model.hf_config import read_config
    from node.model.shards import CheckpointShards

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-30b-a3b-2l", choices=list(SHAPES))
    ap.add_argument("--dir", type=Path, default=Path("/tmp/pin-speed"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokenizer-from", type=Path, default=None)
    ap.add_argument("--machine", default="cpu-2core")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    tok = args.tokenizer_from
    if tok is None:
        from node.model.pretrained import smollm2_dir

        tok = smollm2_dir()
    result: dict = {"benchmark": "pin_speed", "machine": args.machine, "shape": args.shape, "threads": args.threads,
                    "command": "python -m benchmarks.pin_speed " + " ".join(sys.argv[1:] if argv is None else argv)}
    shutil.rmtree(args.dir, ignore_errors=True)
    for fp8 in ("off", "all"):
        directory = write_random(args.shape, args.dir / fp8, tok, 49_152, fp8=fp8)
        cfg = read_config(directory)
        gb = sum(p.stat().st_size for p in directory.glob("*.safetensors")) / 1e9
        checkpoint_digest(CheckpointShards(directory), cfg, torch.bfloat16, threads=args.threads)  # page cache
        seconds: dict[int, list[float]] = {1: [], args.threads: []}
        hashes = set()
        for _ in range(args.repeats):
            for threads in (1, args.threads):
                t = time.perf_counter()
                hashes.add(checkpoint_digest(CheckpointShards(directory), cfg, torch.bfloat16, threads=threads))
                seconds[threads].append(time.perf_counter() - t)
        if len(hashes) != 1:
            raise SystemExit(f"{fp8}: the hashes differ: {hashes}")
        one, many = statistics.median(seconds[1]), statistics.median(seconds[args.threads])
        result[fp8] = {"checkpoint_gb": round(gb, 3), "one_thread_s": [round(x, 3) for x in seconds[1]],
                       "threads_s": [round(x, 3) for x in seconds[args.threads]], "speedup": round(one / many, 2),
                       "gb_per_s": round(gb / many, 3)}
    result["load"] = round(os.getloadavg()[0], 2)
    shutil.rmtree(args.dir, ignore_errors=True)
    return emit(result, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
