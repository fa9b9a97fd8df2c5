"""What a member's CPU pays to take an FP8 run's version 0 from its own checkpoint (issue 25: "version 0 comes from the
member's own copy of the checkpoint"), as `join` does it (`node.roles.version0.local_version0`):

    python -m benchmarks.version0_local [--shape qwen3-30b-a3b-2l] [--dir /tmp/v0local] [--layouts fp8-all,bfloat16]

For each checkpoint layout a random checkpoint of `--shape` is written (block-scaled e4m3 `fp8-all`, the layout
Qwen3 publishes, and plain bf16), the trainer role's publication of version 0 in its served form is made from it
(`publish_model(..., fp8="all")` into a store served on 127.0.0.1), and a member holding the checkpoint checks it
against the signed manifest: every weight quantised by the engines' rule as it is read (`ServedBytes`), every shard
hashed against the manifest, the spec's pin hashed over the values in the same pass; nothing but the manifest is
downloaded. Timed twice (the second from the page cache). The peer in the same run: reading the checkpoint's files
and hashing their bytes once (blake3), which any check of them pays. Figures: seconds, checkpoint GB per second,
the ratio to the peer, the check's peak private host memory above what the process held before it, and the projection to the 48-layer model by its
bytes (a projection, labelled so). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shutil
import time
from pathlib import Path

import torch

from benchmarks import emit

KEY_SEED = b"\x05" * 32


def _read_and_hash(directory: Path) -> float:
    """Seconds to read every safetensors file of `directory` and blake3 its bytes (1 MiB reads)."""
    import blake3

    t = time.perf_counter()
    for f in sorted(directory.glob("*.safetensors")):
        h = blake3.blake3()
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        h.digest()
    return time.perf_counter() - t


def measure(shape: str, layout: str, root: Path, vocab: int) -> dict:
    from benchmarks.random_checkpoint import SHAPES, write_random_shards
    from node.model.config import ModelConfig
    from node.model.fill import build_from_shards
    from node.model.shards import CheckpointShards
    from node.rl.parallel.publish import publish_model
    from node.roles.version0 import local_version0
    from protocol.identity import NodeKey
    from protocol.messages import RunSpec
    from protocol.model_spec import ModelSpec
    from shardcast.server import ShardServer
    from shardcast.store import Store

    key = NodeKey.from_seed(KEY_SEED)
    cfg = ModelConfig(**SHAPES[shape], vocab_size=vocab, max_position_embeddings=4096)
    directory = root / f"ckpt-{layout}"
    write_random_shards(cfg, directory, "all" if layout == "fp8-all" else "off")
    ckpt_gb = sum(f.stat().st_size for f in directory.glob("*.safetensors")) / 1e9
    trainer = Store(root / f"trainer-{layout}")
    model, digest = build_from_shards(cfg, CheckpointShards(directory), torch.bfloat16, "cpu")
    signed = publish_model(model, None, trainer, key, "r", 0, None, None, fp8="all")
    del model
    served_gb = signed.manifest.wire_bytes / 1e9
    peer_s = [_read_and_hash(directory) for _ in range(2)]

    async def check(sources: list[str], n: int) -> float:
        spec = RunSpec(run_id="r", coordinator=key.peer_id, environment="reverse", trainer=key.peer_id,
                       shardcast_sources=sources,
                       model=ModelSpec(source=str(directory), dtype="bfloat16", weights_hash=digest, fp8="all"))
        member = Store(root / f"member-{layout}-{n}")
        t = time.perf_counter()
        got = await local_version0(spec, member, signed.manifest.manifest_hash())
        took = time.perf_counter() - t
        if got is None:
            raise SystemExit(f"{layout}: the member did not take version 0 from its checkpoint")
        return took

    async def run() -> tuple[list[float], int]:
        server = ShardServer(trainer)
        port = await server.start("127.0.0.1", 0)
        try:
            times = [await check([f"http://127.0.0.1:{port}"], n) for n in range(2)]
            return times, server.bytes_served
        finally:
            await server.stop()

    from benchmarks.real_scale import MemorySampler

    gc.collect()
    base = MemorySampler.status()["RssAnon"]
    mem = MemorySampler()  # private memory (RssAnon) every 50 ms while the member checks
    times, served = asyncio.run(run())
    extra_gib = (mem.figures()["host_private_peak_gib"] * 2**30 - base) / 2**30
    out = {"layout": layout, "checkpoint_gb": round(ckpt_gb, 3), "served_version0_gb": round(served_gb, 3),
           "check_s": [round(t, 2) for t in times], "peer_read_hash_s": [round(t, 2) for t in peer_s],
           "check_gb_per_s": round(ckpt_gb / min(times), 3), "peer_gb_per_s": round(ckpt_gb / min(peer_s), 3),
           "check_over_peer": round(min(times) / min(peer_s), 2), "shard_bytes_downloaded": served,
           "check_private_memory_peak_gib": round(extra_gib, 2)}
    shutil.rmtree(root / f"trainer-{layout}", ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks.random_checkpoint import SHAPES
    from node.model.config import ModelConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-30b-a3b-2l", choices=list(SHAPES))
    ap.add_argument("--layouts", default="fp8-all,bfloat16")
    ap.add_argument("--vocab-size", type=int, default=151_936)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/v0local"))
    ap.add_argument("--machine", default="cpu-2core")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    rows = []
    try:
        for layout in args.layouts.split(","):
            rows.append(measure(args.shape, layout, args.dir, args.vocab_size))
            print(rows[-1], flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    cfg = ModelConfig(**SHAPES[args.shape], vocab_size=args.vocab_size, max_position_embeddings=4096)
    full = ModelConfig(**{**SHAPES[args.shape], "num_hidden_layers": 48}, vocab_size=args.vocab_size,
                       max_position_embeddings=4096)
    scale = full.num_parameters() / cfg.num_parameters()
    result = {"bench": "version0_local", "machine": args.machine, "shape": args.shape,
              "params_b": round(cfg.num_parameters() / 1e9, 3), "torch": torch.__version__, "layouts": rows,
              "projection_48_layers": {"note": "a projection by parameter count, not measured",
                                       "params_b": round(full.num_parameters() / 1e9, 2),
                                       **{f"check_s_{r['layout']}": round(min(r["check_s"]) * scale, 1) for r in rows}}}
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
