"""How fast a policy version is staged onto the GPU by the inference role's own path (`StagedVersion.of`,
what `CudaEngine.load_weights` runs off the engine's thread): its tensors from a payload's mapping, through
the pinned ring, to a device copy. `python -m benchmarks.stage_speed [--shape qwen3-30b-a3b-8l] [--repeats 3]`

The version is a random model of `--shape` in bf16, its HF tensors laid back to back in one file on `--dir`
(tmpfs by default, as the sim's payloads on /dev/shm) and mapped, as a fetched payload is (`shardcast.codec.
unflatten` views over the mapping). Conditions, `--repeats` each: alone and, with `--contended`, beside a thread that
holds the interpreter's lock in a pure-Python loop (NAMED STAND-IN for an engine thread between decode steps: the real
one's share of the lock is not measured here). Figures: seconds and GB/s per condition (medians), against the
host-to-device copy of one pinned 1 GiB buffer, the physical peer. Ends with one JSON line.

Session 32 (1x H100, `benchmarks/results/stage_speed-runs-vs-pieces-h100-s32.json`): 10.37 GB staged alone in
0.80-0.83 s (12.7 GB/s, 0.23 of the 55 GB/s pinned copy), where the 5.2B network's node took 1.7-2.5 s on an H200: the
network's neighbours, not the path alone, cost the rest. A variant sending the payload in runs of 64 MiB instead of a
piece a tensor read 0.86-0.96 s and was not kept.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import emit


def busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def main(argv: list[str] | None = None) -> int:
    import benchmarks.device_rollouts as D
    from node.engine import pinned_ring
    from node.engine.weight_staging import StagedVersion
    from node.engine.weights import expected_shapes
    from node.model.checkpoint import state_dict_to_hf

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b-8l", choices=list(D.SHAPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--contended", action="store_true", help="also beside the pure-Python stand-in thread")
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    model = D.random_model(args.shape, torch.bfloat16, "cuda")
    shapes = expected_shapes(model)
    hf = state_dict_to_hf(model)
    total = sum(t.numel() * t.element_size() for t in hf.values())
    path = args.dir / f"stage_speed-{os.getpid()}.bin"
    try:
        mm = np.memmap(path, dtype=np.uint8, mode="w+", shape=(total,))
        at, spans = 0, {}
        for name, t in hf.items():
            n = t.numel() * t.element_size()
            mm[at : at + n] = t.detach().contiguous().view(torch.uint8).reshape(-1).cpu().numpy()
            spans[name] = (at, n, t.dtype, tuple(t.shape))
            at += n
        mm.flush()
        del mm, hf
        print(f"payload: {len(spans)} tensors, {total / 1e9:.2f} GB on {args.dir}", flush=True)
        payload = np.memmap(path, dtype=np.uint8, mode="c")
        base = torch.from_numpy(payload)
        state = {name: base[a : a + n].view(dt).reshape(shape) for name, (a, n, dt, shape) in spans.items()}
        ring = pinned_ring.PinnedRing(device)

        def stage(contended: bool) -> float:
            stop = threading.Event()
            thread = threading.Thread(target=busy, args=(stop,), daemon=True) if contended else None
            if thread:
                thread.start()
            try:
                torch.cuda.synchronize()
                t = time.perf_counter()
                v = StagedVersion.of(model, state, shapes, ring=ring)
                torch.cuda.current_stream().wait_event(v.ready)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - t
                assert v.staged is not None, "no room to stage on the device"
                del v
                return seconds
            finally:
                stop.set()
                if thread:
                    thread.join()

        conditions = (False, True) if args.contended else (False,)
        stage(False)  # warm: the mapping's pages, the allocator
        times: dict[str, list[float]] = {"contended" if c else "alone": [] for c in conditions}
        for _ in range(args.repeats):
            for c in conditions:
                key = "contended" if c else "alone"
                times[key].append(stage(c))
                print(f"{key}: {times[key][-1]:.3f} s", flush=True)
        host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        h2d = 3 * (1 << 30) / (time.perf_counter() - t)
    finally:
        path.unlink(missing_ok=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "benchmark": "stage_speed", "machine": torch.cuda.get_device_name(), "shape": args.shape,
        "tensors": len(spans), "bytes": total, "payload_dir": str(args.dir), "repeats": args.repeats,
        "ring_threads": pinned_ring.HOST_THREADS, "chunk_bytes": pinned_ring.CHUNK_BYTES,
        "stage_s": {k: round(v, 3) for k, v in med.items()},
        "stage_gb_s": {k: round(total / v / 1e9, 2) for k, v in med.items()},
        "all_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "pinned_h2d_gb_s": round(h2d / 1e9, 1),
        "alone_over_h2d_limit": round(total / med["alone"] / h2d, 3),
        "contended_over_alone": round(med["alone"] / med["contended"], 3) if args.contended else None,
    }
    return emit(result, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
