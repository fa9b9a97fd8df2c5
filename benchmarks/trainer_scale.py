"""The trainer role's step on several GPUs: `python -m benchmarks.trainer_scale`.

Times what `torchrun ... join --role trainer --dp/--ep/--cp` runs per step, through the same
classes the role calls (`world.Leader` on rank 0 and `world.follow` on the others, the role's
`publish_trainer` -> `Leader.send_weights`): batch intake (plan + scatter of each rank's share), loss,
backward, clip, AdamW, then publication of the version into a shardcast store and its fetch by
another process onto another GPU. Without the network: the device machine's Python has no libp2p,
so the coordinator's batch is a synthetic `TrainBatch` and the announcement is left out.

Sections (each its own torchrun world; figures from rank 0 as JSON):
- `scale`: a Qwen3-30B-A3B-shaped model with --layers layers (fp32 master weights, bf16 compute,
  fp32 AdamW states), dp=ep=world; steps without publication, with publication waited for, and
  with publication overlapped (the next step runs while rank 0 encodes); then the fetch.
- `cp`: one --cp-seq-token sequence over cp=world ranks (ring attention), --cp-layers layers.
`--tiny`: CPU, gloo, tiny shapes (what the tests run). Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.multigpu_work import H200_BF16_PEAK, shapes, train_flops_per_token

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
       "OMP_NUM_THREADS": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_config(args, layers: int, seq: int):
    cfg = shapes(args.tiny, layers)
    return cfg.model_copy(update={"max_position_embeddings": max(cfg.max_position_embeddings, seq + 1)})


def synthetic_batch(cfg, rows: int, seq: int, seed: int):
    from node.rl.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (rows, seq + 1), generator=g)
    mask = torch.ones(rows, seq, dtype=torch.bool)
    mask[:, : seq // 8] = False  # a prompt
    logp = torch.full((rows, seq), -float(torch.log(torch.tensor(float(cfg.vocab_size)))))
    adv = torch.randn(rows, 1, generator=g).expand(rows, seq).contiguous()
    return TrainBatch(ids[:, :-1], ids[:, 1:], mask, logp, adv, None)


def state_bytes(trainer) -> int:
    """This rank's bytes of parameters + gradients + AdamW state (local shards)."""
    from node.rl.parallel.state import local_tensor as _local

    total = 0
    for p in trainer.model.parameters():
        total += _local(p).numel() * _local(p).element_size()
        if p.grad is not None:
            total += _local(p.grad).numel() * _local(p.grad).element_size()
        for v in trainer.optimizer.state.get(p, {}).values():
            if torch.is_tensor(v) and v.dim() > 0:
                total += _local(v).numel() * _local(v).element_size()
    return total


def rank_stats(trainer, device) -> dict:
    return {"state_gib": state_bytes(trainer) / 2**30,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}


def fetch_main(args) -> dict:
    """Another process: fetch the version through the shard server, put each tensor on --device."""
    from shardcast.fetch import fetch_version
    from shardcast.manifest import TrustedPublishers
    from shardcast.store import Store

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
    t0 = time.perf_counter()
    got = asyncio.run(fetch_version(Store(args.store), [f"http://127.0.0.1:{args.port}"], TrustedPublishers([args.trust]),
                                    args.run_id, args.version))
    fetch_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    checksum, n = 0, 0
    for name, t in got.tensors().items():
        on = t.to(device, non_blocking=False)
        checksum += int(on.reshape(-1).view(torch.uint8)[:4096].to(torch.int64).sum())
        n += on.numel() * on.element_size()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"fetch_s": fetch_s, "h2d_s": time.perf_counter() - t1, "bytes": n, "checksum": checksum}


def _serve_and_fetch(store_root: Path, key, run_id: str, version: int, device: str, timeout: float) -> dict:
    from shardcast.server import ShardServer
    from shardcast.store import Store

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server = ShardServer(Store(store_root))
    port = asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    fetch_store = Path(tempfile.mkdtemp(prefix="ts-fetch-", dir=store_root.parent))
    try:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "benchmarks.trainer_scale", "--fetch", "--port", str(port),
                               "--trust", key.public_bytes.hex(), "--device", device, "--store", str(fetch_store),
                               "--run-id", run_id, "--version", str(version)],
                              capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"fetch process failed: {proc.stderr[-2000:]}")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        got["process_wall_s"] = wall
        return got
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        import shutil

        shutil.rmtree(fetch_store, ignore_errors=True)


def world_main(args) -> None:
    """Inside a torchrun world: rank 0 leads (the role's `Leader`), the others `follow`."""
    from node.model.qwen3_moe import CausalLM
    from node.rl.parallel.dims import ParallelDims
    from node.rl.parallel.world import Leader, follow
    from node.rl.trainer import TrainerConfig

    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    cuda = torch.cuda.is_available()
    if args.world == "scale":
        layers, rows, seq = args.layers, args.rows * world, args.seq
        dims = ParallelDims(dp=world, ep=world, bf16=cuda, activation_checkpointing=args.ac)
    else:
        layers, rows, seq = args.cp_layers, 1, args.cp_seq
        dims = ParallelDims(dp=1, cp=world, bf16=cuda, activation_checkpointing=True)
    cfg = model_config(args, layers, seq)
    with torch.device("meta"):
        skeleton = CausalLM(cfg)
    params = sum(p.numel() for p in skeleton.parameters())
    tcfg = TrainerConfig(updates_per_batch=1, minibatches=1, router_replay=False, lr=1e-5)
    out_dir = Path(args.result).parent
    if rank > 0:
        stats: dict = {}
        follow(dims, tcfg, 0, skeleton, on_stop=lambda r: stats.update(rank_stats(r.trainer, "cuda" if cuda else "cpu")))
        (out_dir / f"{args.world}-rank{rank}.json").write_text(json.dumps(stats))
        return
    from protocol.identity import NodeKey
    from shardcast.publish import PublishOptions
    from node.rl.parallel.publish import publish_trainer

    leader = Leader.connect(dims, tcfg, 0, skeleton)
    result: dict = {"section": args.world, "layers": layers, "params": params, "params_b": params / 1e9,
                    "layout": dims.model_dump(), "world": world, "rows": rows, "seq": seq, "tokens_per_step": rows * seq}
    try:
        t0 = time.perf_counter()
        leader.start_fresh()
        result["start_s"] = time.perf_counter() - t0
        log(f"{args.world}: {params / 1e9:.2f} B params, started in {result['start_s']:.1f}s")
        flops = train_flops_per_token(cfg, seq) * rows * seq * 4 / 3  # fwd+bwd, plus the role's no-grad "before" forward
        result["model_tflop_per_step"] = flops / 1e12
        batches = [synthetic_batch(cfg, rows, seq, i) for i in range(2)]

        def step(i: int) -> float:
            t = time.perf_counter()
            m = leader.train_step(batches[i % 2])
            result.setdefault("losses", []).append(round(m["loss"], 5))
            return time.perf_counter() - t

        times = [step(i) for i in range(args.warmup + args.iters)]
        result["step_times_s"] = [round(t, 4) for t in times]
        t_step = sorted(times[args.warmup:])[len(times[args.warmup:]) // 2]
        result["step_s"] = t_step
        result["mfu"] = flops / t_step / (world * H200_BF16_PEAK) if cuda else None
        log(f"{args.world}: step {t_step:.3f}s mfu {result['mfu']}")
        result["rank0"] = rank_stats(leader.rank.trainer, "cuda" if cuda else "cpu")
        Path(args.result).write_text(json.dumps(result))  # the training figures, whatever follows
        if args.world == "scale" and not args.no_publish:
            from shardcast.store import Store

            key = NodeKey.generate()
            root = Path(args.store) / "origin"
            store = Store(root)
            opts = PublishOptions(threads=args.threads, keep_last=1, keyframe_every=1)  # full versions: two fit in RAM
            # the role today: step, then publish and wait for the signed version (`publish_trainer`)
            t = time.perf_counter()
            t_step = step(1)
            signed = publish_trainer(leader, store, key, "ts", 1, 0, opts)
            waited = time.perf_counter() - t
            result["publish_waited"] = {"step_s": t_step, "publish_s": waited - t_step, **leader.last_publish}
            result["payload_bytes"] = signed.manifest.total_bytes
            result["wire_bytes"] = signed.manifest.wire_bytes
            log(f"publish waited: {result['publish_waited']}")
            Path(args.result).write_text(json.dumps(result))
            # overlapped: the next step runs while rank 0 encodes the previous version
            pending, rows_ov = None, []
            t = time.perf_counter()
            for v in range(2, 2 + args.iters):
                step(v)
                if pending is not None:
                    pending.whole.result()  # the whole publication: wire shards too
                    rows_ov.append(dict(leader.last_publish))
                pending = leader.send_weights_async(store, key, "ts", v, None, opts)
            pending.whole.result()
            rows_ov.append(dict(leader.last_publish))
            per = (time.perf_counter() - t) / args.iters
            result["publish_overlapped"] = rows_ov
            result["overlapped_step_with_publish_s"] = per
            result["waited_step_with_publish_s"] = waited
            result["mfu_with_publish"] = flops / per / (world * H200_BF16_PEAK) if cuda else None
            result["mfu_with_publish_waited"] = flops / waited / (world * H200_BF16_PEAK) if cuda else None
            log(f"overlapped: {per:.3f}s per step+publish; {rows_ov}")
            Path(args.result).write_text(json.dumps(result))
            # the last version (a full one) to another process's GPU
            last = 1 + args.iters
            dev = f"cuda:{1 if torch.cuda.device_count() > 1 else 0}" if cuda else "cpu"
            got = _serve_and_fetch(root, key, "ts", last, dev, args.timeout)
            total = rows_ov[-1]["total_s"] + got["fetch_s"] + got["h2d_s"]
            result["publish_full"] = {**rows_ov[-1], **got, "end_to_end_s": total}
            result["publish_gb_s"] = result["payload_bytes"] / 1e9 / total
            log(f"publish to another GPU: {result['publish_full']}")
            result["rank0"] = rank_stats(leader.rank.trainer, "cuda" if cuda else "cpu")
    finally:
        leader.stop()
    Path(args.result).write_text(json.dumps(result))


def run_world(args, section: str, out: Path, extra: list[str]) -> dict:
    env = dict(os.environ, **ENV)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}",
           "-m", "benchmarks.trainer_scale", "--world", section, "--result", str(out), *extra]
    log(f"world {section}: {' '.join(cmd[-len(extra) - 4:])}")
    t0 = time.perf_counter()
    log_path = Path(args.log_dir or out.parent) / f"trainer_scale-{section}.log"
    with open(log_path, "w") as f:  # streamed: a killed world still leaves its log
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
    tail = log_path.read_text()[-6000:]
    if not out.exists():
        log(f"world {section} failed ({rc}):\n{tail[-3000:]}")
        return {"section": section, "error": f"rc {rc}", "tail": tail[-1500:]}
    if rc != 0:
        log(f"world {section} ended with rc {rc}; partial figures kept")
    res = json.loads(out.read_text())
    res["wall_s"] = time.perf_counter() - t0
    if rc != 0:
        res["error"] = f"rc {rc} (figures up to the failure)"
    for f in sorted(out.parent.glob(f"{section}-rank*.json")):
        res[f.stem.split("-")[-1]] = json.loads(f.read_text())
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=max(torch.cuda.device_count(), 2))
    ap.add_argument("--sections", default="scale,cp")
    ap.add_argument("--layers", type=int, default=16, help="scale: decoder layers of the Qwen3-30B-A3B shape")
    ap.add_argument("--rows", type=int, default=4, help="scale: sequences per GPU")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--ac", action="store_true", help="scale: activation checkpointing")
    ap.add_argument("--cp-layers", type=int, default=4)
    ap.add_argument("--cp-seq", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=min(24, os.cpu_count() or 1))
    ap.add_argument("--no-publish", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--timeout", type=float, default=500)
    ap.add_argument("--out", help="write the whole result JSON here")
    ap.add_argument("--log-dir")
    ap.add_argument("--store", help="where the shardcast store lives (default: /dev/shm if roomy)")
    # inside a world / the fetch process
    ap.add_argument("--world", choices=["scale", "cp"])
    ap.add_argument("--result")
    ap.add_argument("--fetch", action="store_true")
    ap.add_argument("--port", type=int)
    ap.add_argument("--trust")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--run-id", default="ts")
    ap.add_argument("--version", type=int, default=0)
    args = ap.parse_args(argv)
    if args.fetch:
        print(json.dumps(fetch_main(args)), flush=True)
        return 0
    if args.world:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        world_main(args)
        from node.rl.parallel.dims import shutdown_distributed

        shutdown_distributed()
        return 0
    work = Path(tempfile.mkdtemp(prefix="trainer-scale-"))
    store = args.store or tempfile.mkdtemp(prefix="ts-store-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    common = ["--layers", str(args.layers), "--rows", str(args.rows), "--seq", str(args.seq), "--cp-layers",
              str(args.cp_layers), "--cp-seq", str(args.cp_seq), "--iters", str(args.iters), "--warmup",
              str(args.warmup), "--threads", str(args.threads), "--store", store, "--timeout", str(args.timeout)]
    common += (["--tiny"] if args.tiny else []) + (["--ac"] if args.ac else []) + (["--no-publish"] if args.no_publish else [])
    sections = {s: run_world(args, s, work / f"{s}.json", common) for s in args.sections.split(",")}
    import shutil

    shutil.rmtree(store, ignore_errors=True)
    scale, cp = sections.get("scale", {}), sections.get("cp", {})
    ranks = [scale.get("rank0", {})] + [v for k, v in scale.items() if k.startswith("rank") and k != "rank0"]
    summary = {
        "params_b": scale.get("params_b"),
        "state_gib_total": sum(r.get("state_gib") or 0 for r in ranks) if ranks else None,
        "peak_gib_per_gpu": max((r.get("peak_gib") or 0 for r in ranks), default=None),
        "mfu": scale.get("mfu"), "mfu_with_publish": scale.get("mfu_with_publish"),
        "mfu_with_publish_waited": scale.get("mfu_with_publish_waited"),
        "step_s": scale.get("step_s"), "publish_gb_s": scale.get("publish_gb_s"),
        "cp_tokens": cp.get("seq") if "error" not in cp and cp else None, "cp_step_s": cp.get("step_s"),
        "cp_mfu": cp.get("mfu"),
        "cp_peak_gib_per_gpu": max([(cp.get("rank0") or {}).get("peak_gib") or 0] +
                                   [(cp.get(k) or {}).get("peak_gib") or 0 for k in cp if k.startswith("rank")]) if cp else None,
        "gpus": args.gpus, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "sections": sections}, indent=1))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
