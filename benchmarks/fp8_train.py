"""Trainer step time, MFU and loss curves, FP8 vs bf16, on a Qwen3-30B-A3B-shaped MoE:
`python -m benchmarks.fp8_train [--layers 2] [--steps 50]` (needs CUDA).

Both arms start from the same weights (bf16 parameters, AdamW) and see the same batches of a
learnable synthetic language (a noisy permutation chain: token t is followed by perm[t] 90% of
the time), so their loss curves can be laid side by side. MFU counts matmul FLOPs of the forward
and backward (6 x tokens x active matmul parameters, plus causal attention) against the H200's
datasheet dense peak (989 TFLOP/s bf16) and against the measured bf16 matmul rate.
Dense parts: a projection's forward+backward alone, FP8 vs bf16, at the trainer's token count.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F

from benchmarks.fp8_common import cuda_time, log, machine_facts, qwen3_30b_a3b_config, write_result
from node.model.qwen3_moe import CausalLM
from node.rl.fp8 import FP8Matmul, apply_fp8_training

PEAK_BF16 = 989e12
"""H200 SXM dense bf16 datasheet rate (FP8: twice that)."""


def batches(vocab: int, n: int, batch: int, seq: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    alphabet = 4096
    perm = torch.randperm(alphabet, generator=g)
    out = []
    for _ in range(n):
        x = torch.empty(batch, seq, dtype=torch.long)
        x[:, 0] = torch.randint(0, alphabet, (batch,), generator=g)
        noise = torch.rand(batch, seq, generator=g) < 0.1
        rnd = torch.randint(0, alphabet, (batch, seq), generator=g)
        for t in range(1, seq):
            x[:, t] = torch.where(noise[:, t], rnd[:, t], perm[x[:, t - 1]])
        out.append(x.cuda())
    return out


def step_flops(cfg, tokens: int, seq: int) -> float:  # noqa: ANN001
    h, hd = cfg.hidden_size, cfg.head_dim
    attn = h * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    experts = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
    active = cfg.num_hidden_layers * (attn + experts + h * cfg.num_experts) + cfg.vocab_size * h
    attn_scores = cfg.num_hidden_layers * 2 * 2 * seq * cfg.num_attention_heads * hd / 2  # per token, causal
    return 3 * tokens * (2 * active + attn_scores)


def train(model: CausalLM, data: list[torch.Tensor]) -> tuple[list[float], float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    losses, times = [], []
    for x in data:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(x)
        loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    steady = sorted(times[3:])
    return losses, steady[len(steady) // 2]


def dense_part(tokens: int, n: int, k: int) -> dict:
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    flops = 6 * tokens * n * k

    def run(fn) -> None:  # noqa: ANN001
        y = fn(x, w)
        torch.autograd.grad(y, (x, w), dy)

    t8 = cuda_time(lambda: run(FP8Matmul.apply))
    tb = cuda_time(lambda: run(F.linear))
    return {"shape": [tokens, n, k], "fp8_tflops": flops / t8 / 1e12, "bf16_tflops": flops / tb / 1e12,
            "fp8_mfu_vs_bf16_peak": flops / t8 / PEAK_BF16, "bf16_mfu": flops / tb / PEAK_BF16}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    args = ap.parse_args()
    torch.manual_seed(0)
    result: dict = {"machine": machine_facts(), "layers": args.layers, "steps": args.steps,
                    "tokens_per_step": args.batch * args.seq}
    log("dense parts")
    tokens = args.batch * args.seq
    result["dense_parts"] = [dense_part(tokens, 4096, 2048), dense_part(tokens, 2048, 4096),
                             dense_part(tokens, 1536, 2048)]
    log(str(result["dense_parts"]))
    cfg = qwen3_30b_a3b_config(args.layers)
    data = batches(cfg.vocab_size, args.steps, args.batch, args.seq)
    with torch.device("cuda"):
        base = CausalLM(cfg).to(torch.bfloat16)
    init = copy.deepcopy(base.state_dict())
    flops = step_flops(cfg, tokens, args.seq)
    for name in ("bf16", "fp8"):
        model = base if name == "bf16" else apply_fp8_training(base)
        model.load_state_dict(init)
        model.train()
        log(f"training {name}")
        losses, t = train(model, data)
        result[f"{name}_losses"] = losses
        result[f"{name}_step_s"] = t
        result[f"{name}_mfu_vs_bf16_peak"] = flops / t / PEAK_BF16
        log(f"{name}: step {t:.3f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    result["fp8_vs_bf16_step_speedup"] = result["bf16_step_s"] / result["fp8_step_s"]
    result["final_loss_gap"] = result["fp8_losses"][-1] - result["bf16_losses"][-1]
    write_result("fp8_train", result)


if __name__ == "__main__":
    main()
