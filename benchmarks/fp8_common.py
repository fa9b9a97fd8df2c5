"""Shared pieces of the FP8 benchmarks: the Qwen3-30B-A3B-shaped config, machine facts, timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from node.model.config import ModelConfig


def qwen3_30b_a3b_config(layers: int) -> ModelConfig:
    """Qwen3-30B-A3B's shapes (hidden 2048, 128 experts, top-8, expert width 768) with `layers` layers."""
    return ModelConfig(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096,
    )


def machine_facts() -> dict:
    facts = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = None
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
        facts["cuda"] = torch.version.cuda
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            facts["driver"] = out.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            facts["driver"] = None
    return facts


def cuda_time(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() measured with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read plus written per second."""
    src = torch.randn(512 * 1024 * 1024, device="cuda", dtype=torch.float32)  # 2 GiB
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), iters=10)
    bw = 2 * src.numel() * 4 / t
    del src, dst
    torch.cuda.empty_cache()
    return bw


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_result(name: str, result: dict) -> None:
    """Write the figures under $OUT (device runs) or benchmarks/results, and print the JSON line."""
    line = json.dumps(result, sort_keys=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            f.write(line + "\n")
    print(line, flush=True)
