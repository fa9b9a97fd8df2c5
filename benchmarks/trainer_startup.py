"""Trainer start-up memory, rank by rank: `python -m benchmarks.trainer_startup [--layers 16 --world 4]`.

Writes a random Qwen3-MoE-shaped checkpoint in bf16 (benchmarks/random_checkpoint.py, shard by shard),
then starts a `--world`-rank trainer world on the CPU under gloo (dp = ep = world, FSDP2), through the
classes the trainer role runs (`world.Leader` on rank 0, `world.follow` on the others): every rank
reads only its own parameter rows from the safetensors files (`load.read_own_shards`). Each rank
reports its peak RSS (getrusage, file pages it touched included) against the issue's bound
1.5 x (model bytes / world) + 2 GiB, model bytes being the trainer's weights as it holds them (float32
master copies). `--check`: every rank also compares its shards with the one-process model's (tests).
Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
SHAPE = dict(model_type="qwen3_moe", hidden_size=1024, intermediate_size=3072, moe_intermediate_size=512,
             num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
             norm_topk_prob=True, vocab_size=49152, max_position_embeddings=512)
"""qwen3-moe-small's widths (benchmarks/random_checkpoint.py); 16 layers: 0.95B parameters."""
TINY = dict(SHAPE, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, vocab_size=512)


def bound_bytes(model_bytes: int, world: int) -> float:
    """The issue's aim for a rank's peak RSS at start-up: 1.5 x its share of the model + 2 GiB."""
    return 1.5 * model_bytes / world + 2 * GIB


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def model_config(args):
    from node.model.config import ModelConfig

    return ModelConfig(**(TINY if args.tiny else SHAPE), num_hidden_layers=args.layers)


def worker(args) -> None:
    """One rank of the torchrun world."""
    from node.model.fill import meta_model
    from node.rl.parallel.dims import ParallelDims
    from node.rl.parallel.world import Leader, follow
    from node.rl.trainer import TrainerConfig

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    cfg = model_config(args)
    dims = ParallelDims(dp=world, ep=world)
    tcfg = TrainerConfig(updates_per_batch=1, minibatches=1, router_replay=False)
    skeleton = meta_model(cfg, torch.float32)
    out = args.out / f"rank{rank}.json"
    stats: dict = {"rank": rank, "rss_before_start_gib": peak_rss_bytes() / GIB}

    def record(r) -> None:
        t0 = time.perf_counter()
        local = {n: (p.to_local() if hasattr(p, "to_local") else p) for n, p in r.trainer.model.named_parameters()}
        stats["local_param_bytes"] = sum(t.numel() * t.element_size() for t in local.values())
        stats["peak_rss_gib"] = peak_rss_bytes() / GIB
        if args.check:
            stats["mismatched"] = mismatched(r, args.checkpoint)
        stats["record_s"] = time.perf_counter() - t0

    if rank > 0:
        follow(dims, tcfg, 0, skeleton, on_stop=record)
        out.write_text(json.dumps(stats))
        return
    leader = Leader.connect(dims, tcfg, 0, skeleton)
    try:
        t0 = time.perf_counter()
        leader.start_from_checkpoint(args.checkpoint)
        stats["start_s"] = time.perf_counter() - t0
        leader.collectives.submit(record, leader.rank).result()
    finally:
        leader.stop()
    out.write_text(json.dumps(stats))


def mismatched(rank, checkpoint: Path) -> list[str]:
    """Names of parameters whose local part differs from the one-process model's (small models only)."""
    from node.model.checkpoint import load_checkpoint
    from node.rl.parallel.state import local_part, local_tensor

    whole = {n: p.detach() for n, p in load_checkpoint(checkpoint, torch.float32).named_parameters()}
    with torch.no_grad():
        return [n for n, p in rank.trainer.model.named_parameters()
                if not torch.equal(local_tensor(p), local_tensor(local_part(rank.groups, n, p, whole[n])))]


def run(args) -> dict:
    from benchmarks.random_checkpoint import write_random_shards
    from node.model.fill import meta_model

    cfg = model_config(args)
    params = sum(p.numel() for p in meta_model(cfg, torch.float32).parameters())
    scratch = Path(tempfile.mkdtemp(prefix="trainer-startup-", dir=args.scratch))
    checkpoint = args.checkpoint or scratch / "checkpoint"
    if not (checkpoint / "config.json").exists():
        t0 = time.perf_counter()
        write_random_shards(cfg, checkpoint, "off", torch.bfloat16, max_shard_bytes=512 << 20)
        print(f"wrote {params / 1e9:.2f}B parameters to {checkpoint} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}",
           "-m", "benchmarks.trainer_startup", "--worker", "--out", str(scratch), "--checkpoint", str(checkpoint),
           "--layers", str(args.layers), *(["--tiny"] if args.tiny else []), *(["--check"] if args.check else [])]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"the trainer world failed ({proc.returncode}): {proc.stderr[-3000:]}")
        ranks = [json.loads((scratch / f"rank{r}.json").read_text()) for r in range(args.world)]
        checkpoint_bytes = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # the checkpoint too, unless --checkpoint named one elsewhere
    wall = time.perf_counter() - t0
    model_bytes = params * 4
    bound = bound_bytes(model_bytes, args.world)
    return {"benchmark": "trainer_startup", "machine": args.machine, "world": args.world, "layout": "dp=ep=world, fsdp",
            "backend": "gloo", "params_b": round(params / 1e9, 4), "layers": args.layers,
            "model_bytes_gib": round(model_bytes / GIB, 3), "checkpoint_gib": round(checkpoint_bytes / GIB, 3),
            "bound_per_rank_gib": round(bound / GIB, 3),
            "peak_rss_gib_per_rank": [round(r["peak_rss_gib"], 3) for r in ranks],
            "local_param_gib_per_rank": [round(r["local_param_bytes"] / GIB, 3) for r in ranks],
            "local_param_bytes_total": sum(r["local_param_bytes"] for r in ranks), "model_bytes": model_bytes,
            "peak_rss_over_bound_max": round(max(r["peak_rss_gib"] for r in ranks) * GIB / bound, 3),
            "start_s": round(ranks[0]["start_s"], 2), "world_wall_s": round(wall, 1),
            "mismatched": sorted({n for r in ranks for n in r.get("mismatched", [])}) if args.check else None,
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="test widths (seconds)")
    ap.add_argument("--check", action="store_true", help="every rank compares its shards with the whole model")
    ap.add_argument("--checkpoint", type=Path, default=None, help="reuse a checkpoint (default: write one)")
    ap.add_argument("--scratch", type=Path, default=None)
    ap.add_argument("--machine", default="cpu-2core")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return None
    result = run(args)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
