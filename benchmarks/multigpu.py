"""Multi-GPU figures at every GPU count given (default 1, 2, 4, 8 up to what the host has):
expert-parallel MoE forward/backward, the distributed trainer (FSDP2 + EP), the built-in engine with
expert parallelism, and GPU -> shardcast -> another process's GPU. Each run is its own torchrun world
(one process per GPU), bounded by a timeout; a failed run is recorded and the rest go on.

    python -m benchmarks.multigpu [--gpus 1,2] [--layers 8] [--out PATH]

NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1). Without CUDA it runs the same code on gloo with tiny shapes (`--tiny`), which
is how the tests exercise it. Ratios are against 1 GPU measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)
REPO = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def facts() -> dict:
    from benchmarks.fp8_common import machine_facts

    f = machine_facts()
    f["gpus"] = torch.cuda.device_count()
    f["cpus"] = os.cpu_count()
    if torch.cuda.is_available():
        f["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        try:
            f["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired) as exc:
            f["topology"] = f"unavailable: {exc}"
    f["env"] = dict(NO_MULTICAST)
    return f


def run_world(section: str, n: int, extra: list[str], timeout: float) -> dict:
    """One torchrun world of n processes running `benchmarks.multigpu_work SECTION`."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               "-m", "benchmarks.multigpu_work", section, "--result", str(result), *extra]
        env = {**os.environ, **NO_MULTICAST, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return {"gpus": n, "error": f"timed out after {timeout:.0f}s", "tail": str(exc.stderr or "")[-1500:]}
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not result.exists():
            return {"gpus": n, "error": f"exit {proc.returncode}", "tail": (proc.stdout + proc.stderr)[-3000:]}
        out = json.loads(result.read_text())
        out["wall_s"] = round(wall, 1)
        return out


def scaling(rows: list[dict], key: str) -> None:
    """Add `<key>_scaling_efficiency` = throughput at n / (n x throughput at 1 GPU)."""
    base = next((r for r in rows if r.get("gpus") == 1 and key in r), None)
    for r in rows:
        if base and key in r:
            r[f"{key}_scaling_efficiency"] = r[key] / (r["gpus"] * base[key])


def main(argv: list[str] | None = None) -> int:
    have = torch.cuda.device_count()
    default_gpus = ",".join(str(n) for n in (1, 2, 4, 8) if n <= max(have, 2))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default=default_gpus, help="comma-separated GPU (process) counts")
    ap.add_argument("--sections", default="moe,trainer,engine,shardcast")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the Qwen3-30B-A3B-shaped model")
    ap.add_argument("--big-layers", type=int, default=16, help="trainer: also this many layers at the largest GPU count (0: skip)")
    ap.add_argument("--tokens", type=int, default=16384, help="moe: tokens per GPU")
    ap.add_argument("--seq", type=int, default=2048, help="trainer: sequence length")
    ap.add_argument("--rows", type=int, default=4, help="trainer: sequences per GPU")
    ap.add_argument("--batches", default="1,64,256", help="engine: sequences per GPU")
    ap.add_argument("--new-tokens", type=int, default=32, help="engine: tokens generated per sequence")
    ap.add_argument("--greedy-sampler", action="store_true", help="engine: greedy argmax instead of the engine's CPU sampler")
    ap.add_argument("--shardcast-gib", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=240, help="seconds per torchrun world")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU tests)")
    ap.add_argument("--machine", default="cpu-2core" if not have else f"h200x{have}")
    ap.add_argument("--out", help="results JSON (default: $OUT/multigpu-MACHINE.json or benchmarks/results/)")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.gpus.split(",")]
    if have:
        counts = [n for n in counts if n <= have]
    sections = args.sections.split(",")
    tiny = ["--tiny"] if args.tiny else []
    result: dict = {"benchmark": "multigpu", "machine": args.machine, "facts": facts(), "gpu_counts": counts,
                    "not_run": [f"{n} GPUs: the host has {have}" for n in (4, 8) if have and n > have]}
    log(f"{result['facts'].get('gpus')} GPUs, torch {torch.__version__}, NCCL {result['facts'].get('nccl')}; counts {counts}")

    def section(name: str, extra: list[str], ns: list[int], key: str | None) -> list[dict]:
        rows = []
        for n in ns:
            log(f"{name}: {n} GPU(s) {' '.join(extra)}")
            r = run_world(name, n, extra + tiny, args.timeout)
            log(f"{name}: {n} GPU(s) -> " + (r["error"] + "\n" + r.get("tail", "") if "error" in r else
                                             json.dumps(r)))
            rows.append(r)
        if key:
            scaling(rows, key)
        return rows

    if "moe" in sections:
        result["moe"] = section("moe", ["--tokens", str(args.tokens), "--iters", "10"], counts, "fwd_bwd_tok_s")
        scaling(result["moe"], "fwd_tok_s")
    if "trainer" in sections:
        shape = ["--seq", str(args.seq), "--rows", str(args.rows)]
        result["trainer"] = section("trainer", ["--layers", str(args.layers), *shape], counts, "tok_s")
    if "engine" in sections:
        rows = section("engine", ["--layers", str(args.layers), "--batches", args.batches, "--new-tokens",
                                  str(args.new_tokens), *(["--greedy-sampler"] if args.greedy_sampler else [])], counts, None)
        base = next((r for r in rows if r.get("gpus") == 1 and "rows" in r), None)
        for r in rows:
            for row in r.get("rows", []):
                ref = next((b for b in (base or {}).get("rows", []) if b["batch_per_gpu"] == row["batch_per_gpu"]), None)
                if ref:
                    row["decode_scaling_efficiency"] = row["decode_tok_s"] / (r["gpus"] * ref["decode_tok_s"])
                    row["forward_scaling_efficiency"] = row["forward_tok_s"] / (r["gpus"] * ref["forward_tok_s"])
        result["engine"] = rows
    if "shardcast" in sections:
        log("shardcast: GPU 0 -> publish -> serve -> fetch in another process -> GPU 1")
        with tempfile.TemporaryDirectory() as tmp:
            res = Path(tmp) / "sc.json"
            cmd = [sys.executable, "-m", "benchmarks.multigpu_shardcast", "publish", "--gib", str(args.shardcast_gib),
                   "--result", str(res)]
            try:
                proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
                result["shardcast"] = json.loads(res.read_text()) if proc.returncode == 0 and res.exists() else \
                    {"error": f"exit {proc.returncode}", "tail": (proc.stdout + proc.stderr)[-3000:]}
            except subprocess.TimeoutExpired:
                result["shardcast"] = {"error": f"timed out after {args.timeout:.0f}s"}
        log(f"shardcast -> {json.dumps(result['shardcast'])[:1500]}")

    if "trainer" in sections and args.big_layers and max(counts) > 1:  # last: the longest, the least needed
        result["trainer"] += section("trainer", ["--layers", str(args.big_layers), *shape], [max(counts)], None)

    summary = summarize(result)
    result["summary"] = summary
    out = Path(args.out) if args.out else (Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "results") / f"multigpu-{args.machine}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {out}")
    print(json.dumps(summary), flush=True)
    return 0


def summarize(result: dict) -> dict:
    """The headline figures: one flat dict (the benchmark's last JSON line)."""
    s: dict = {"machine": result["machine"], "gpus": result["facts"].get("gpus"), "driver": (result["facts"].get("driver") or "").split("\n")[0] or None,
               "torch": result["facts"].get("torch"), "nccl": result["facts"].get("nccl")}
    for r in result.get("moe", []):
        if "error" in r:
            s[f"moe_{r['gpus']}gpu_error"] = r["error"]
            continue
        s[f"moe_{r['gpus']}gpu_fwd_bwd_tok_s"] = round(r["fwd_bwd_tok_s"])
        s[f"moe_{r['gpus']}gpu_fwd_bwd_scaling"] = round(r.get("fwd_bwd_tok_s_scaling_efficiency", float("nan")), 3)
        s[f"moe_{r['gpus']}gpu_rel_err"] = r["rel_err_vs_one_process"]
    for r in result.get("trainer", []):
        tag = f"trainer_{r['gpus']}gpu"
        if "error" in r:
            s[f"{tag}_error"] = r["error"]
            continue
        tag += f"_{r['layers']}l"
        s[f"{tag}_step_s"] = round(r["step_s"], 4)
        s[f"{tag}_mfu"] = round(r["mfu"], 4)
        if "tok_s_scaling_efficiency" in r:
            s[f"{tag}_scaling"] = round(r["tok_s_scaling_efficiency"], 3)
    for r in result.get("engine", []):
        if "error" in r:
            s[f"engine_{r['gpus']}gpu_error"] = r["error"]
            continue
        for row in r["rows"]:
            tag = f"engine_{r['gpus']}gpu_b{row['batch_per_gpu']}"
            s[f"{tag}_decode_tok_s"] = round(row["decode_tok_s"], 1)
            s[f"{tag}_forward_tok_s"] = round(row["forward_tok_s"], 1)
            if "decode_scaling_efficiency" in row:
                s[f"{tag}_scaling"] = round(row["decode_scaling_efficiency"], 3)
                s[f"{tag}_forward_scaling"] = round(row["forward_scaling_efficiency"], 3)
    sc = result.get("shardcast", {})
    for k in ("end_to_end_s_per_gb", "publish_s_per_gb", "fetch_s_per_gb", "peer_d2d_s_per_gb",
              "ratio_end_to_end_over_peer_d2d", "checksums_equal", "error"):
        if k in sc:
            s[f"shardcast_{k}"] = round(sc[k], 4) if isinstance(sc[k], float) else sc[k]
    return s


if __name__ == "__main__":
    raise SystemExit(main())
