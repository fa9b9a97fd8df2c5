"""FP8 vs bf16 decode on a Qwen3-30B-A3B-shaped MoE, against `transformers` generate():
`python -m benchmarks.fp8_engine [--layers 8] [--new-tokens 64]` (needs CUDA).

Decode tokens/s at batch 1, 64 and 256 for: our FP8 path and our bf16 path (torch `_grouped_mm`
experts as in the model), each in the fixed-batch decode loop (`benchmarks.fixed_decode`: the engine's
decode forward in a CUDA graph, no sampling), and transformers `generate()` (greedy,
fixed length). Achieved bytes/s of each step against the measured copy bandwidth. Then the
mismatch: KL between the bf16 and FP8 models' next-token distributions on the same tokens, and
between the FP8 engine and a bf16 / FP8 trainer with and without router replay.
"""

from __future__ import annotations

import argparse
import copy

import torch

from benchmarks.fixed_decode import FixedBatchDecoder
from benchmarks.fp8_common import copy_bandwidth, cuda_time, log, machine_facts, qwen3_30b_a3b_config, write_result
from node.engine.fp8.model import quantize_model_fp8
from node.model.qwen3_moe import CausalLM
from node.rl.fp8 import apply_fp8_training

PROMPT = 16


def step_bytes(cfg, batch: int, ctx: int, fp8: bool) -> float:
    """Fewest bytes one decode step must read: weights it touches once, plus the KV cache."""
    wb = 1 if fp8 else 2
    h, hd = cfg.hidden_size, cfg.head_dim
    attn = h * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)  # expected distinct experts per layer
    expert = 3 * h * cfg.moe_intermediate_size
    per_layer = (attn + touched * expert) * wb + h * e * 2
    kv = batch * ctx * 2 * cfg.num_key_value_heads * hd * 2
    return cfg.num_hidden_layers * (per_layer + kv) + cfg.vocab_size * h * 2


def time_decode(model: CausalLM, batch: int, new_tokens: int, use_graph: bool = True) -> float:
    """Seconds per decode step (median over repeated decode runs of `new_tokens` steps)."""
    dec = FixedBatchDecoder(model, batch, PROMPT + new_tokens + 1, use_graph=use_graph)
    prompt = torch.randint(0, model.config.vocab_size, (batch, PROMPT), device="cuda")
    first = dec.prefill(prompt).argmax(-1)
    if use_graph:
        dec.capture()

    def run() -> None:
        nxt = first
        for i in range(new_tokens):
            nxt = dec.step(nxt, torch.full((batch,), PROMPT + i, device="cuda", dtype=torch.long)).argmax(-1)

    t = cuda_time(run, iters=3, warmup=1)
    del dec
    torch.cuda.empty_cache()
    return t / new_tokens


def time_hf(cfg, batch: int, new_tokens: int, hf_model) -> float:  # noqa: ANN001
    ids = torch.randint(0, cfg.vocab_size, (batch, PROMPT), device="cuda")
    mask = torch.ones_like(ids)

    def run() -> None:
        hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    t = cuda_time(run, iters=2, warmup=1)
    return t / new_tokens


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean per-token KL(p || q)."""
    lp, lq = p_logits.float().log_softmax(-1), q_logits.float().log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


@torch.no_grad()
def mismatch(bf16: CausalLM, fp8: CausalLM, fp8_trainer: CausalLM, seqs: torch.Tensor) -> dict:
    eng = fp8(seqs)
    ref = bf16(seqs)
    replay = eng.routed_experts
    out = {
        "kl_bf16_engine_vs_fp8_engine": kl(ref.logits, eng.logits),
        "route_agreement_fp8_vs_bf16": float(
            (eng.routed_experts.sort(-1).values == ref.routed_experts.sort(-1).values).float().mean()),
        "kl_fp8_engine_vs_bf16_trainer_no_replay": kl(eng.logits, ref.logits),
        "kl_fp8_engine_vs_bf16_trainer_replay": kl(eng.logits, bf16(seqs, routed_experts=replay).logits),
        "kl_fp8_engine_vs_fp8_trainer_no_replay": kl(eng.logits, fp8_trainer(seqs).logits),
        "kl_fp8_engine_vs_fp8_trainer_replay": kl(eng.logits, fp8_trainer(seqs, routed_experts=replay).logits),
    }
    nxt = seqs[:, 1:, None]
    lp_e = eng.logits[:, :-1].float().log_softmax(-1).gather(-1, nxt).squeeze(-1)
    lp_r = ref.logits[:, :-1].float().log_softmax(-1).gather(-1, nxt).squeeze(-1)
    out["mean_abs_logprob_diff_bf16_vs_fp8"] = float((lp_e - lp_r).abs().mean())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    result: dict = {"machine": machine_facts(), "layers": args.layers, "new_tokens": args.new_tokens}
    bw = copy_bandwidth()
    result["copy_bandwidth_bytes_per_s"] = bw
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    cfg = qwen3_30b_a3b_config(args.layers)
    with torch.device("cuda"):
        bf16 = CausalLM(cfg).to(torch.bfloat16).eval()
    result["params"] = sum(p.numel() for p in bf16.parameters())
    fp8 = quantize_model_fp8(copy.deepcopy(bf16)).eval()
    log(f"models built: {result['params'] / 1e9:.2f}B parameters")

    rows = []
    for b in batches:
        ctx = PROMPT + args.new_tokens
        row = {"batch": b}
        for name, model in (("fp8", fp8), ("bf16", bf16)):
            t = time_decode(model, b, args.new_tokens)
            row[f"{name}_tok_s"] = b / t
            row[f"{name}_step_ms"] = t * 1e3
            row[f"{name}_roofline_share"] = step_bytes(cfg, b, ctx, name == "fp8") / bw / t
            log(f"batch {b} {name}: {b / t:.0f} tok/s, {t * 1e3:.2f} ms/step")
        if b == 1:
            t = time_decode(fp8, b, 16, use_graph=False)
            row["fp8_eager_step_ms"] = t * 1e3
        row["roofline_step_ms_fp8"] = step_bytes(cfg, b, ctx, True) / bw * 1e3
        row["roofline_step_ms_bf16"] = step_bytes(cfg, b, ctx, False) / bw * 1e3
        rows.append(row)
    result["decode"] = rows

    log("mismatch")
    fp8_trainer = apply_fp8_training(copy.deepcopy(bf16)).eval()
    seqs = torch.randint(0, cfg.vocab_size, (8, 256), device="cuda")
    result["mismatch"] = mismatch(bf16, fp8, fp8_trainer, seqs)
    log(str(result["mismatch"]))
    del fp8_trainer
    torch.cuda.empty_cache()

    if not args.skip_hf:
        try:
            from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

            hf_cfg = Qwen3MoeConfig(**{k: v for k, v in cfg.to_hf_dict().items()
                                       if k not in ("architectures", "torch_dtype", "model_type")})
            del fp8, bf16
            torch.cuda.empty_cache()
            with torch.device("cuda"):
                torch.set_default_dtype(torch.bfloat16)
                hf = Qwen3MoeForCausalLM(hf_cfg).eval()
                torch.set_default_dtype(torch.float32)
            for row in rows:
                t = time_hf(cfg, row["batch"], min(args.new_tokens, 32), hf)
                row["transformers_tok_s"] = row["batch"] / t
                log(f"batch {row['batch']} transformers: {row['batch'] / t:.0f} tok/s")
        except Exception as exc:  # noqa: BLE001 - the peer failing is reported, not fatal
            result["transformers_error"] = repr(exc)[:300]
    for row in rows:
        row["fp8_vs_bf16"] = row["fp8_tok_s"] / row["bf16_tok_s"]
        if "transformers_tok_s" in row:
            row["fp8_vs_transformers"] = row["fp8_tok_s"] / row["transformers_tok_s"]
    write_result("fp8_engine", result)


if __name__ == "__main__":
    main()
