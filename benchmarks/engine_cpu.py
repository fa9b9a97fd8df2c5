"""Built-in engine vs `transformers` generate() on the same tiny MoE, same batch and lengths, CPU.

    python -m benchmarks.engine_cpu [--batch 32] [--new-tokens 64] [--repeats 3]

Both sample (temperature 1, no top-p) exactly --new-tokens tokens per sequence from the same
weights (our checkpoint loaded into transformers' Qwen3-MoE). Prints progress, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time

import torch

from node.engine import Engine, Request, SamplingParams
from node.model import CausalLM, ModelConfig, save_checkpoint


def bench_ours(model, prompts, new_tokens) -> float:
    engine = Engine(model, max_batch=len(prompts), eos_id=-1, max_seq_len=prompts.shape[1] + new_tokens + 1)
    reqs = [Request(str(i), p.tolist(), SamplingParams(max_new_tokens=new_tokens, seed=i)) for i, p in enumerate(prompts)]
    t = time.perf_counter()
    out = engine.generate(reqs)
    dt = time.perf_counter() - t
    assert all(len(c.token_ids) == new_tokens for c in out)
    return len(prompts) * new_tokens / dt


def bench_hf(hf, prompts, new_tokens) -> float:
    t = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0, top_p=1.0,
                          top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    dt = time.perf_counter() - t
    assert out.shape[1] == prompts.shape[1] + new_tokens
    return len(prompts) * new_tokens / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      num_experts=8, num_experts_per_tok=2, max_position_embeddings=256)
    model = CausalLM(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        save_checkpoint(model, d)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    prompts = torch.randint(3, 96, (args.batch, args.prompt_len))
    bench_ours(model, prompts[:2], 4), bench_hf(hf, prompts[:2], 4)  # warm-up
    ours, theirs = [], []
    for r in range(args.repeats):
        ours.append(bench_ours(model, prompts, args.new_tokens))
        theirs.append(bench_hf(hf, prompts, args.new_tokens))
        print(f"repeat {r}: ours {ours[-1]:.0f} tok/s, transformers {theirs[-1]:.0f} tok/s", flush=True)
    best_ours, best_hf = max(ours), max(theirs)
    print(json.dumps({
        "benchmark": "engine_cpu", "machine": f"{platform.machine()} cpu x{args.threads} threads",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "model": "qwen3_moe hidden128 L4 E8 top2", "batch": args.batch, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "ours_tok_s": round(best_ours, 1), "transformers_tok_s": round(best_hf, 1),
        "ratio_ours_over_transformers": round(best_ours / best_hf, 2),
    }))


if __name__ == "__main__":
    main()
