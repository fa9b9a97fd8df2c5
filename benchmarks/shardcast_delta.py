"""`python -m benchmarks.shardcast_delta`: bytes on the wire for a delta version vs the full one,
on two consecutive policy versions from real RL steps of our model (`primerl-node train-local`).

Runs train-local twice with the same seed on one thread (deterministic on CPU): N steps and
N+1 steps; their checkpoints are versions N and N+1 of one policy. A third run of N steps checks
that determinism (bit-exact). Then, over a real server on 127.0.0.1: a client that holds v N
fetches v N+1 published as a delta; a fresh client fetches v N+1 published as a full version.
Both results are checked bit-exact against the checkpoint. Repeated for the bf16 cast that
inference engines load. The peer (shardcast 0.3.2) has neither compression nor deltas: it sends
the file as is, so its bytes on the wire are the safetensors file's size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[shardcast-delta {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def train(out: Path, steps: int, task: str, lr: float | None) -> dict[str, torch.Tensor]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "node.cli", "--log-level", "WARNING", "train-local", "--task", task, "--steps", str(steps),
           "--out", str(out), "--seed", "0", "--threads", "1"] + ([] if lr is None else ["--lr", str(lr)])
    log(" ".join(cmd[2:]))
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    return load_file(str(out / "checkpoint" / "model.safetensors"))


async def wire_bytes(work: Path, prev: dict, cur: dict, v: int, shard_mib: int) -> dict:
    from protocol.identity import NodeKey
    from shardcast.fetch import fetch_version
    from shardcast.manifest import TrustedPublishers
    from shardcast.publish import PublishOptions, publish
    from shardcast.server import ShardServer
    from shardcast.store import Store

    key = NodeKey.generate()
    trusted = TrustedPublishers([key.peer_id])
    opts = PublishOptions(shard_size=shard_mib << 20, keyframe_every=8)
    delta_origin, full_origin = Store(work / "delta-origin"), Store(work / "full-origin")
    publish(delta_origin, key, "r", v, prev, options=opts)
    dm = publish(delta_origin, key, "r", v + 1, cur, parent=v, options=opts).manifest
    fm = publish(full_origin, key, "r", v + 1, cur, options=opts).manifest
    assert dm.encoding == "delta" and fm.encoding == "full"
    out = {}
    for name, origin in (("delta", delta_origin), ("full", full_origin)):
        server = ShardServer(origin)
        port = await server.start("127.0.0.1", 0)
        try:
            client = Store(work / f"client-{name}")
            url = [f"http://127.0.0.1:{port}"]
            if name == "delta":  # the client already follows the run: it holds v
                await fetch_version(client, url, trusted, "r", v)
            got = await fetch_version(client, url, trusted, "r", v + 1)
            for k, t in cur.items():
                assert torch.equal(got.tensors()[k].view(torch.uint8), t.contiguous().view(torch.uint8)), k
            out[name] = got.wire_bytes_downloaded
        finally:
            await server.stop()
    out["raw"] = fm.total_bytes
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="RL steps before the measured step")
    ap.add_argument("--task", default="reverse")
    ap.add_argument("--lr", type=float, default=None, help="RL learning rate (default: train-local's)")
    ap.add_argument("--shard-mib", type=int, default=8)
    ap.add_argument("--machine", default="cpu-2core")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="shardcast-delta-"))
    try:
        n = args.steps
        prev = train(work / "a", n, args.task, args.lr)
        cur = train(work / "b", n + 1, args.task, args.lr)
        again = train(work / "c", n, args.task, args.lr)
        deterministic = all(torch.equal(prev[k], again[k]) for k in prev)
        changed = sum(int((prev[k] != cur[k]).sum()) for k in prev)
        numel = sum(t.numel() for t in prev.values())
        log(f"versions {n} and {n + 1}: {numel} parameters, {changed / numel:.1%} changed; deterministic rerun: {deterministic}")
        result = {"benchmark": "shardcast_delta", "machine": args.machine, "task": args.task, "versions": [n, n + 1], "lr": args.lr or "train-local default",
                  "parameters": numel, "changed_fraction": round(changed / numel, 4), "train_deterministic": deterministic,
                  "checkpoint_dtype": str(next(iter(prev.values())).dtype).removeprefix("torch.")}
        for label, p, c in (("ckpt", prev, cur), ("bf16", {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in prev.items()},
                                                   {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in cur.items()})):
            r = asyncio.run(wire_bytes(work / label, p, c, n, args.shard_mib))
            shutil.rmtree(work / label, ignore_errors=True)
            result[f"{label}_raw_bytes"] = r["raw"]
            result[f"{label}_full_wire_bytes"] = r["full"]
            result[f"{label}_delta_wire_bytes"] = r["delta"]
            result[f"{label}_ratio_full_over_delta"] = round(r["full"] / r["delta"], 2)
            result[f"{label}_ratio_peer_over_delta"] = round(r["raw"] / r["delta"], 2)
            log(f"{label}: raw {r['raw']} B, full {r['full']} B, delta {r['delta']} B -> {r['full'] / r['delta']:.2f}x fewer than full")
        out = Path(args.out or REPO / "benchmarks" / "results" / f"shardcast_delta-{args.machine}.json")
        out.write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {out}")
        print(json.dumps(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
