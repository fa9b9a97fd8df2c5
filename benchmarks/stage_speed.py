"""How fast a policy version is staged onto the GPU by the inference role's own path (`StagedVersion.of`,
what `CudaEngine.load_weights` runs off the engine's thread): its tensors from a payload's mapping, through
the pinned ring, to a device copy, in the conditions a role meets on a host it shares.

    python -m benchmarks.stage_speed [--shape qwen3-30b-a3b-8l] [--repeats 2] [--threads 4,8] [--paths mirror,runs,pieces]

The version is a random model of `--shape` in bf16, its HF tensors laid back to back in one file on `--dir`
(tmpfs by default, as the sim's payloads on /dev/shm), mapped afresh for each staging as a fetched payload is
(`shardcast.fetch.PayloadTensors` over a new mapping), in a process with one intra-op thread (`--omp 1`: the
sim's roles run with OMP_NUM_THREADS=1). Three paths, alternated: `mirror` (the mapping copied whole in 64 MiB
pieces, each served tensor a view of the copy: `weight_staging.MirrorPlan`, the role's since session 34), `runs`
(`PinnedRing.copy_many`: 64 MiB runs of the mapping, a device buffer and one batched copy a run: session 33's) and
`pieces` (a ring piece a tensor: before, the peer). Each staged version is then applied to the served model
(`apply_s`: the engine's pause, which the mirror's strided views may lengthen). Conditions, `--repeats` each, for
each ring size in `--threads`:
- `alone`;
- `gil`: beside a thread of this process that holds the interpreter's lock in a pure-Python loop (NAMED
  STAND-IN for the engine's thread between decode steps: the real one's share of the lock is not measured here);
- `wire`, `wire_nice`: beside another process encoding wire shards (`shardcast.codec.encode_shard`, the
  trainer's step 2 of `publish_stream`: deltas of a bf16 shard, zstd) on `--neighbours` threads, at the
  process's priority and at `PublishOptions.wire_nice` (what the trainer does since session 33). In the 5.2B
  network on one H200 the trainer's 12 encoding threads ran while the node staged the same version.
Figures: seconds and GB/s per condition (medians), the ring threads' seconds split into host copies and waits for
the device (`pinned_ring.RingSeconds`, per thread), against the host-to-device copy of one pinned 1 GiB
buffer, the physical peer. Ends with one JSON line.

Session 32 (1x H100, `benchmarks/results/stage_speed-runs-vs-pieces-h100-s32.json`, before the fresh mapping,
one intra-op thread and the neighbours): 10.37 GB staged alone in 0.80-0.83 s (12.7 GB/s, 0.23 of the 55 GB/s
pinned copy), where the 5.2B network's node took 1.7-2.5 s on an H200. A variant sending the payload in runs of
64 MiB (a host copy a run, then a copy to the device a tensor) read 0.86-0.96 s and was not kept; in the network
the staging took the same ~2.0 s for 10.4 GB (bf16) and 4.4 GB (FP8 served form), so the count of calls, not the
bytes, looked to set it there: `runs` now also makes one copy to the device a run.

Session 33 (1x H100, `benchmarks/results/stage_speed-runs-neighbours-h100-s33.json`): alone runs 0.909 s vs pieces
1.308 s (1.44x); beside wire encoding 1.205 vs 1.589 s; at niceness +10 1.286 vs 1.438 s (no gain from the
niceness). The `gil` condition made one staging take 60.8 s (cut): see docs/scale.md, session 33.

Session 34 (1x H100, `stage_speed-mirror-h100-s34.json`, `stage_speed-mirror-gil-wire-h100-s34.json`): alone mirror
0.627 s vs runs 0.723 s vs pieces 1.133 s; beside wire encoding 0.801 vs 0.837 s; beside the busy thread 3.77 vs
113.4 s; `apply_s` 7.8 ms alone on every path. On the CPU (`--device cpu`, cpu-2core, 0.52B shape): mirror 0.156 vs
0.187 s alone, 0.602 vs 7.815 s beside the busy thread (`stage_speed-mirror-vs-runs-cpu-2core.json`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import emit

SHARD = 64 << 20


def busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def encode_forever(threads: int, nice: int) -> None:
    """The `wire` neighbour (its own process): `threads` threads encoding a bf16 shard's delta against its parent
    until stdin closes, at `nice` (`shardcast.publish.lower_priority`); prints `ready` once they run."""
    from shardcast.codec import encode_shard
    from shardcast.publish import lower_priority

    rng = np.random.default_rng(0)
    parent = rng.standard_normal(SHARD // 2, dtype=np.float32).astype(np.float16).view(np.uint8)
    raw = parent.copy()
    raw[::97] ^= 1  # an RL step's small changes: most words differ in their low bits
    stop = threading.Event()

    def work() -> None:
        lower_priority(nice)
        while not stop.is_set():
            encode_shard(0, raw, parent, word=2)

    pool = [threading.Thread(target=work, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    print("ready", flush=True)
    sys.stdin.read()
    stop.set()


@contextlib.contextmanager
def neighbour(kind: str, threads: int, nice: int):
    """The condition's neighbour running for the body's length: None, the `gil` stand-in thread, or a `wire`
    encoding process."""
    if kind == "gil":
        stop = threading.Event()
        thread = threading.Thread(target=busy, args=(stop,), daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
    elif kind.startswith("wire"):
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.stage_speed", "--encode-forever", str(threads),
                                 str(nice)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        try:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("the wire-encoding neighbour did not start")
            time.sleep(0.5)  # its threads at full speed
            yield
        finally:
            proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    else:
        yield


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "--encode-forever":
        encode_forever(int(sys.argv[2]), int(sys.argv[3]))
        return 0
    import benchmarks.device_rollouts as D
    from node.engine import pinned_ring
    from node.engine.weight_staging import MirrorPlans, StagedVersion
    from shardcast.fetch import PayloadTensors
    from shardcast.manifest import TensorEntry
    from node.engine.weights import expected_shapes
    from node.model.checkpoint import state_dict_to_hf
    from shardcast.publish import PublishOptions

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b-8l", choices=list(D.SHAPES))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", default=str(pinned_ring.HOST_THREADS), help="ring sizes, comma-separated")
    ap.add_argument("--conditions", default="alone,gil,wire,wire_nice")
    ap.add_argument("--paths", default="mirror,runs,pieces", help="mirror: the payload copied whole (the role's since "
                    "session 34); runs: PinnedRing.copy_many (session 33); pieces: a ring piece a tensor (before)")
    ap.add_argument("--neighbours", type=int, default=PublishOptions().threads,
                    help="the wire neighbour's threads (default: the trainer's publication threads on this host)")
    ap.add_argument("--omp", type=int, default=1, help="this process's intra-op threads (a role's: 1)")
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a CPU role's path (nothing staged ahead: `apply` copies from the mapping, from one view "
                    "a served tensor (mirror) or tensor by tensor (runs, pieces)); the figure is then `apply_s`")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.omp)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    conditions = args.conditions.split(",")
    sizes = [int(x) for x in args.threads.split(",")]
    paths = args.paths.split(",")
    wire_nice = PublishOptions().wire_nice
    model = D.random_model(args.shape, torch.bfloat16, args.device)
    shapes = expected_shapes(model)
    hf = state_dict_to_hf(model)
    total = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in hf.values())
    path = args.dir / f"stage_speed-{os.getpid()}.bin"
    try:
        mm = np.memmap(path, dtype=np.uint8, mode="w+", shape=(total,))
        at, spans = 0, []
        for name, t in hf.items():  # back to back, 64-byte aligned, as `shardcast.codec` lays a payload out
            n = t.numel() * t.element_size()
            mm[at : at + n] = t.detach().contiguous().view(torch.uint8).reshape(-1).cpu().numpy()
            spans.append(TensorEntry(name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                                     offset=at, nbytes=n))
            at += -(-n // 64) * 64
        mm.flush()
        del mm, hf
        print(f"payload: {len(spans)} tensors, {total / 1e9:.2f} GB on {args.dir}; ring threads {sizes}; "
              f"conditions {conditions}; neighbours {args.neighbours} threads", flush=True)

        mirrors = MirrorPlans()  # the engine's: made at the first version (the warm-up), reused after
        sync = torch.cuda.synchronize if cuda else (lambda: None)

        def stage(ring: pinned_ring.PinnedRing, way: str) -> tuple[float, float, float, float, float]:
            StagedVersion.PATH = way
            payload = np.memmap(path, dtype=np.uint8, mode="c")  # a new mapping, as each fetched version's
            state = PayloadTensors(spans, payload, None)
            sync()
            t = time.perf_counter()
            v = StagedVersion.of(model, state, shapes, ring=ring, mirrors=mirrors)
            if cuda:
                torch.cuda.current_stream().wait_event(v.ready)
            sync()
            seconds = time.perf_counter() - t
            assert v.staged is not None or (not cuda and way != "mirror"), "no room to stage on the device"
            held = [x for t in (v.staged or {}).values() for x in (t if isinstance(t, tuple) else (t,))]
            one_copy = len({x.untyped_storage().data_ptr() for x in held}) == 1  # views of the payload's copy
            assert one_copy == (way == "mirror"), f"{way}: not staged by its path"
            t = time.perf_counter()
            v.apply()
            sync()
            applied = time.perf_counter() - t
            per, spent = v.times.ring_threads or 1, (v.times.ring_host_s, v.times.ring_host_cpu_s, v.times.ring_wait_s)
            del v, state, payload
            return seconds, spent[0] / per, spent[2] / per, spent[1] / per, applied

        times: dict[str, list[tuple[float, float, float, float, float]]] = {}
        for size in sizes:
            ring = pinned_ring.PinnedRing(device, threads=size) if cuda else None
            for way in paths:
                stage(ring, way)  # warm: the allocator, the ring's threads and device buffers
            for c in conditions:
                with neighbour(c, args.neighbours, wire_nice if c == "wire_nice" else 0):
                    for _ in range(args.repeats):
                        for way in paths:  # alternated: both see the neighbour alike
                            key = f"{way}/{c}/{size}"
                            times.setdefault(key, []).append(stage(ring, way))
                            print(f"{key}: {times[key][-1][0]:.3f} s (per ring thread: host copies "
                                  f"{times[key][-1][1]:.3f} s ({times[key][-1][3]:.3f} s running), device waits "
                                  f"{times[key][-1][2]:.3f} s); applied in {times[key][-1][4]:.3f} s", flush=True)
            del ring
        host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=cuda)  # the peer: one host-to-device copy
        dev = torch.empty(1 << 30, dtype=torch.uint8, device=device)  # (on the CPU: one memory copy)
        dev.copy_(host, non_blocking=True)
        sync()
        t = time.perf_counter()
        for _ in range(3):
            dev.copy_(host, non_blocking=True)
        sync()
        h2d = 3 * (1 << 30) / (time.perf_counter() - t)
    finally:
        path.unlink(missing_ok=True)
    med = {k: statistics.median(x[0] for x in v) for k, v in times.items()}
    def peer(key: str) -> str:  # the same path and ring size alone
        path, _, size = key.split("/")
        return f"{path}/alone/{size}"

    first = f"{paths[0]}/alone/{sizes[0]}"
    result = {
        "benchmark": "stage_speed", "machine": torch.cuda.get_device_name() if cuda else f"cpu-{os.cpu_count()}core",
        "device": args.device, "cpus": os.cpu_count(),
        "shape": args.shape, "tensors": len(spans), "bytes": total, "payload_dir": str(args.dir),
        "repeats": args.repeats, "omp_threads": args.omp, "ring_threads": sizes, "paths": paths, "chunk_bytes": pinned_ring.CHUNK_BYTES,
        "neighbour_threads": args.neighbours, "wire_nice": wire_nice,
        "stage_s": {k: round(v, 3) for k, v in med.items()},
        "stage_gb_s": {k: round(total / v / 1e9, 2) for k, v in med.items()},
        "ring_host_s_per_thread": {k: round(statistics.median(x[1] for x in v), 3) for k, v in times.items()},
        "ring_host_cpu_s_per_thread": {k: round(statistics.median(x[3] for x in v), 3) for k, v in times.items()},
        "ring_wait_s_per_thread": {k: round(statistics.median(x[2] for x in v), 3) for k, v in times.items()},
        "all_s": {k: [round(x[0], 3) for x in v] for k, v in times.items()},
        "pinned_h2d_gb_s": round(h2d / 1e9, 1),
        "over_h2d_limit": {k: round(total / v / h2d, 3) for k, v in med.items()},
        "over_alone": {k: round(med[peer(k)] / v, 3) for k, v in med.items() if peer(k) in med},
        "apply_s": {k: round(statistics.median(x[4] for x in v), 4) for k, v in times.items()},
        "stage_and_apply_s": {k: round(statistics.median(x[0] + x[4] for x in v), 4) for k, v in times.items()},
        "over_pieces": {k: round(med[f"pieces/{k.split('/', 1)[1]}"] / v, 3) for k, v in med.items()
                        if not k.startswith("pieces/") and f"pieces/{k.split('/', 1)[1]}" in med},
        "mirror_over_runs": {k.removeprefix("mirror/"): round(med[f"runs/{k[7:]}"] / v, 3) for k, v in med.items()
                             if k.startswith("mirror/") and f"runs/{k[7:]}" in med},
        "mirror_over_runs_with_apply": {
            k.removeprefix("mirror/"): round(statistics.median(x[0] + x[4] for x in times[f"runs/{k[7:]}"])
                                             / statistics.median(x[0] + x[4] for x in v), 3)
            for k, v in times.items() if k.startswith("mirror/") and f"runs/{k[7:]}" in times},
        "first_alone_s": med.get(first),
    }
    return emit(result, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
