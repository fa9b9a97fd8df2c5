"""Built-in engine vs `transformers` generate() on the same tiny MoE, same requests and batch, CPU.

    python -m benchmarks.engine_cpu [--batch 32] [--requests 128] [--repeats 2] [--threads 2]
    python -m benchmarks.engine_cpu --model smollm2-135m-instruct --batch 16 --requests 32 --new-tokens 32

`--model` takes a ModelSpec source (default: a random tiny MoE); with a real checkpoint both engines
load the same HF-layout directory (ours through the model spec, transformers' with from_pretrained)
and get the same random-token prompts.

Two workloads, the same weights (our checkpoint loaded into transformers' Qwen3-MoE), both
sampling at temperature 1 without top-p:
- fixed: `batch` prompts, exactly `new_tokens` each: raw decode speed, no batching advantage.
- rl: `requests` prompts whose completion lengths are heavy-tailed (as RL rollouts are: most
  short, a few long), `batch` at a time. transformers runs them in batches of `batch`, each batch
  until its longest request is done (static batching); ours keeps `batch` slots busy, admitting
  the next request as soon as one finishes (continuous batching).
Throughput counts only requested tokens. Prints progress, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time

import torch

from node.engine import Engine, Request, SamplingParams
from node.model import CausalLM, ModelConfig, save_checkpoint
from node.model.spec import ModelSpec, load_model


def rl_lengths(n: int, seed: int = 0, short: int = 16, long: int = 192) -> list[int]:
    """Heavy-tailed lengths: 80% between 8 and `short`, 20% up to `long`."""
    rng = random.Random(seed)
    return [rng.randint(8, short) if rng.random() < 0.8 else rng.randint(short, long) for _ in range(n)]


def rl_lengths_for(n: int, new_tokens: int) -> list[int]:
    return rl_lengths(n) if new_tokens >= 64 else rl_lengths(n, short=max(8, new_tokens // 4), long=new_tokens * 3)


def run_ours(model, prompts, lengths, batch) -> float:
    engine = Engine(model, max_batch=batch, eos_id=-1, max_seq_len=prompts.shape[1] + max(lengths) + 1)
    reqs = [Request(str(i), p.tolist(), SamplingParams(max_new_tokens=n, seed=i)) for i, (p, n) in enumerate(zip(prompts, lengths))]
    t = time.perf_counter()
    out = engine.generate(reqs)
    dt = time.perf_counter() - t
    assert [len(c.token_ids) for c in out] == lengths
    return sum(lengths) / dt


def run_hf(hf, prompts, lengths, batch) -> float:
    t = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk, n = prompts[i : i + batch], max(lengths[i : i + batch])
        with torch.no_grad():
            out = hf.generate(chunk, attention_mask=torch.ones_like(chunk), do_sample=True, temperature=1.0, top_p=1.0,
                              top_k=0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        assert out.shape[1] == chunk.shape[1] + n
    return sum(lengths) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="a ModelSpec source (default: random tiny MoE)")
    ap.add_argument("--out", default=None, help="also write the JSON line to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    torch.manual_seed(0)
    if args.model is None:
        cfg = ModelConfig(vocab_size=96, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          num_experts=8, num_experts_per_tok=2, max_position_embeddings=512)
        model = CausalLM(cfg).eval()
        with tempfile.TemporaryDirectory() as d:
            save_checkpoint(model, d)
            hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        name = "qwen3_moe hidden128 L4 E8 top2 (float32)"
    else:
        loaded = load_model(ModelSpec(source=args.model, dtype="float32"))
        model, cfg, name = loaded.model, loaded.model.config, f"{args.model} (float32)"
        hf = transformers.AutoModelForCausalLM.from_pretrained(loaded.directory, dtype=torch.float32).eval()
    vocab = cfg.vocab_size
    run_ours(model, torch.randint(3, vocab, (2, 8)), [4, 4], 2), run_hf(hf, torch.randint(3, vocab, (2, 8)), [4, 4], 2)
    workloads = {
        "fixed": (torch.randint(3, vocab, (args.batch, args.prompt_len)), [args.new_tokens] * args.batch),
        "rl": (torch.randint(3, vocab, (args.requests, args.prompt_len)), rl_lengths_for(args.requests, args.new_tokens)),
    }
    result = {"benchmark": "engine_cpu", "machine": f"{platform.machine()} 2-core cpu, {args.threads} torch threads",
              "torch": torch.__version__, "transformers": transformers.__version__,
              "model": name, "batch": args.batch, "prompt_len": args.prompt_len}
    for name, (prompts, lengths) in workloads.items():
        ours, theirs = [], []
        for r in range(args.repeats):
            ours.append(run_ours(model, prompts, lengths, args.batch))
            theirs.append(run_hf(hf, prompts, lengths, args.batch))
            print(f"{name} repeat {r}: ours {ours[-1]:.0f} tok/s, transformers {theirs[-1]:.0f} tok/s", flush=True)
        # ours and theirs alternate, so each pair saw similar machine load: the paired median ratio
        # is the figure; the best of each is reported beside it
        ratios = sorted(o / t for o, t in zip(ours, theirs))
        result[name] = {"requests": len(lengths), "tokens": sum(lengths), "ours_tok_s": round(max(ours), 1),
                        "transformers_tok_s": round(max(theirs), 1),
                        "ratio_ours_over_transformers": round(ratios[len(ratios) // 2], 2),
                        "ratio_of_bests": round(max(ours) / max(theirs), 2)}
    result["load_avg_1m_end"] = round(__import__("os").getloadavg()[0], 2)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
