"""Peak host memory of loading a checkpoint: `python -m benchmarks.load_memory [--layers 4] [--before DIR]`.

Writes a random Qwen3-MoE-shaped bf16 checkpoint (benchmarks/random_checkpoint.py) with SmolLM2's
tokenizer, then loads it through `node.model.spec.load_model` in a fresh process per case and reads
that process's peak private memory (RssAnon sampled every 5 ms, less its value before loading: the
page cache of the checkpoint's mapped files left out) and its peak RSS (getrusage, those pages in):
- `bf16`: the spec's model in bfloat16 on the CPU;
- `fp8-experts`: the same served with FP8 experts (`apply_fp8_mode`; with this tree, swapped in on the
  meta model and filled per tensor; an older tree quantises the loaded bf16 model).
`--before DIR`: also run every case with DIR (another checkout, e.g. the main branch before streaming
loads) first on the path: the ratio is measured in the same run. Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
CASE = r"""
import inspect, json, resource, sys, threading
import torch
from node.model.spec import load_model
from protocol.model_spec import ModelSpec
from node.engine.fp8.model import apply_fp8_mode

def anon_kib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon:"))

peak_anon, done = [anon_kib()], threading.Event()
def sample():  # RssAnon every 5 ms: the private memory, without the checkpoint's page-cache pages
    while not done.wait(0.005):
        peak_anon[0] = max(peak_anon[0], anon_kib())
threading.Thread(target=sample, daemon=True).start()
base = anon_kib()
directory, case = sys.argv[1], sys.argv[2]
spec = ModelSpec(source=directory, dtype="bfloat16")
if case == "bf16":
    model = load_model(spec).model
elif "prepare" in inspect.signature(load_model).parameters:
    model = load_model(spec, prepare=lambda m: apply_fp8_mode(m, "experts")).model
else:
    model = apply_fp8_mode(load_model(spec).model, "experts")
done.set()
held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"base_kib": base, "peak_anon_kib": max(peak_anon[0], anon_kib()), "peak_kib": peak, "held_bytes": held}))
"""


def measure(tree: Path, directory: Path, case: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", CASE, str(directory), case], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{tree} {case}: {out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {"peak_rss_gib": round(r["peak_kib"] * 1024 / GIB, 3),
            "load_anon_gib": round((r["peak_anon_kib"] - r["base_kib"]) * 1024 / GIB, 3),
            "model_gib": round(r["held_bytes"] / GIB, 3)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--before", type=Path, default=None, help="another checkout to measure first (e.g. /work/main)")
    ap.add_argument("--machine", default="cpu-2core")
    args = ap.parse_args(argv)
    from benchmarks.random_checkpoint import SHAPES, write_random_shards
    from node.model.config import ModelConfig
    from node.model.pretrained import smollm2_dir

    cfg = ModelConfig(**SHAPES["qwen3-moe-small"], vocab_size=49152, max_position_embeddings=512)
    cfg = cfg.model_copy(update={"num_hidden_layers": args.layers})
    scratch = Path(tempfile.mkdtemp(prefix="load-memory-"))
    try:
        directory = write_random_shards(cfg, scratch / "m", "off", torch.bfloat16, max_shard_bytes=256 << 20,
                                        tokenizer_from=smollm2_dir())
        size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        result: dict = {"benchmark": "load_memory", "machine": args.machine, "layers": args.layers,
                        "checkpoint_gib": round(size / GIB, 3)}
        for case in ("bf16", "fp8-experts"):
            after = measure(ROOT, directory, case)
            result[case] = {"after": after}
            if args.before is not None:
                before = measure(args.before, directory, case)
                result[case]["before"] = before
                result[case]["load_anon_before_over_after"] = round(before["load_anon_gib"] / after["load_anon_gib"], 2)
            print(f"{case}: {result[case]}", file=sys.stderr)
        result["load_avg_1m"] = round(os.getloadavg()[0], 2)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
