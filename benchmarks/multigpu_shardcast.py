"""Weight publication GPU -> shardcast -> another process's GPU, timed per phase.

`publish` (one process, GPU 0): weights on the GPU -> host -> `shardcast.publish` (zstd shards,
hashes, signed manifest) into a store on tmpfs -> served by `ShardServer` on 127.0.0.1. It starts
`fetch` in a second process (GPU 1 when there is one), which downloads and verifies every shard
through `fetch_version`, puts the tensors on its GPU and returns per-tensor checksums, which must
equal the publisher's. The peer measured in the same run is a direct device-to-device copy
(`tensor.to("cuda:1")`, NVLink/PCIe), the floor for moving the same bytes without shardcast.
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


def checksums(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """Exact per-tensor fingerprint: the sum of the raw 16-bit words (as int64)."""
    return {k: int(v.view(torch.int16).to(torch.int64).sum()) for k, v in state.items()}


def make_state(total_bytes: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Expert-shaped bf16 tensors (Qwen3-30B-A3B gate_up [128, 1536, 2048] is 768 MiB; we use
    [16, 1536, 2048] pieces of 96 MiB) of N(0, 0.02) values drawn on the GPU."""
    g = torch.Generator(device=device).manual_seed(0)
    state, i = {}, 0
    piece = (16, 1536, 2048)
    while sum(t.numel() * 2 for t in state.values()) < total_bytes:
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = (torch.randn(piece, generator=g, device=device) * 0.02).to(torch.bfloat16)
        i += 1
    return state


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def publish_side(args) -> dict:
    from protocol.identity import NodeKey
    from shardcast.publish import PublishOptions, publish
    from shardcast.server import ShardServer
    from shardcast.store import Store

    gpus = torch.cuda.device_count()
    src = torch.device("cuda", 0) if gpus else torch.device("cpu")
    dst = f"cuda:{1 if gpus > 1 else 0}" if gpus else "cpu"
    state = make_state(int(args.gib * 2**30), src)
    raw = sum(t.numel() * 2 for t in state.values())
    want = checksums(state)
    result: dict = {"bytes": raw, "tensors": len(state), "src": str(src), "dst": dst, "zstd_threads": args.threads}

    if gpus > 1:  # the peer: device to device, no host, no shardcast
        for _ in range(2):
            _sync()
            t0 = time.perf_counter()
            moved = {k: v.to(dst) for k, v in state.items()}
            _sync()
            result["peer_d2d_s"] = time.perf_counter() - t0
        del moved

    work = Path(tempfile.mkdtemp(prefix="mg-shardcast-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    _sync()
    t0 = time.perf_counter()
    host = {k: v.cpu() for k, v in state.items()}
    result["d2h_s"] = time.perf_counter() - t0
    key = NodeKey.generate()
    t0 = time.perf_counter()
    signed = publish(Store(work / "origin"), key, "mg", 0, host, options=PublishOptions(threads=args.threads))
    result["publish_s"] = time.perf_counter() - t0
    result["wire_bytes"] = signed.manifest.wire_bytes
    result["shards"] = len(signed.manifest.shards)
    del host

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server = ShardServer(Store(work / "origin"))
    port = asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    try:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "benchmarks.multigpu_shardcast", "fetch", "--port", str(port),
                               "--trust", key.public_bytes.hex(), "--device", dst, "--store", str(work / "fetcher")],
                              capture_output=True, text=True, timeout=args.timeout)
        result["fetch_process_s"] = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"fetch process failed: {proc.stderr[-2000:]}")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    result.update({k: got[k] for k in ("fetch_s", "h2d_s")})
    result["checksums_equal"] = got["checksums"] == want
    result["end_to_end_s"] = result["d2h_s"] + result["publish_s"] + result["fetch_s"] + result["h2d_s"]
    gb = raw / 1e9
    for k in ("d2h_s", "publish_s", "fetch_s", "h2d_s", "end_to_end_s", "peer_d2d_s"):
        if k in result:
            result[k.replace("_s", "_s_per_gb")] = result[k] / gb
    if "peer_d2d_s" in result:
        result["ratio_end_to_end_over_peer_d2d"] = result["end_to_end_s"] / result["peer_d2d_s"]
    return result


def fetch_side(args) -> dict:
    from shardcast.fetch import fetch_version
    from shardcast.manifest import TrustedPublishers
    from shardcast.store import Store

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # context up before the clock starts
    t0 = time.perf_counter()
    got = asyncio.run(fetch_version(Store(args.store), [f"http://127.0.0.1:{args.port}"], TrustedPublishers([args.trust]), "mg", 0))
    fetch_s = time.perf_counter() - t0
    host = got.tensors()
    t0 = time.perf_counter()
    on_gpu = {k: v.to(device) for k, v in host.items()}
    _sync()
    h2d_s = time.perf_counter() - t0
    return {"fetch_s": fetch_s, "h2d_s": h2d_s, "checksums": checksums(on_gpu)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("side", choices=["publish", "fetch"])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--port", type=int)
    ap.add_argument("--trust")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--store")
    ap.add_argument("--result")
    args = ap.parse_args(argv)
    out = publish_side(args) if args.side == "publish" else fetch_side(args)
    if args.result:
        Path(args.result).write_text(json.dumps(out))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
