"""`python -m benchmarks.validator_deltas`: what the validator's resident model holds for the versions it
judges (node/roles/resident_policy.py), against one whole model per version.

A float32 master model (the trainer's) takes AdamW steps at lr 1e-6 on random gradients; each step is
published in bfloat16 and added to a `ResidentPolicies` of a bf16 model; per version it prints the
deltas' host bytes, the time to add the version and to switch back to version 0, and ends with one
JSON line. The changed share is what bf16 rounding leaves of an lr-1e-6 step: an RL-shaped update size,
not a trained run's gradients.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.random_checkpoint import SHAPES
from node.model.checkpoint import load_hf_state_dict, state_dict_to_hf
from node.model.config import ModelConfig
from node.model.qwen3_moe import CausalLM
from node.roles.resident_policy import ResidentPolicies, raw_tensors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-moe-small", choices=list(SHAPES))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig(**{**SHAPES[args.shape], "num_hidden_layers": args.layers}, vocab_size=args.vocab_size,
                      max_position_embeddings=256)
    master = CausalLM(cfg)
    with torch.no_grad():
        for w in master.parameters():
            w.normal_(0, 0.02)
    opt = torch.optim.AdamW(master.parameters(), lr=args.lr)

    def published() -> dict[str, torch.Tensor]:
        return {k: v.to(torch.bfloat16) for k, v in state_dict_to_hf(master).items()}

    model = CausalLM(cfg).to(torch.bfloat16)
    load_hf_state_dict(model, published())
    model_bytes = sum(t.numel() * t.element_size() for t in raw_tensors(model).values())
    held = ResidentPolicies(model.eval(), 0, b"\0" * 32)
    rows = []
    for v in range(1, args.versions + 1):
        for w in master.parameters():
            w.grad = torch.randn_like(w)
        opt.step()
        t0 = time.perf_counter()
        held.add(v, published(), bytes([v]) * 32)
        add_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        held.activate(0)
        switch_s = time.perf_counter() - t0
        rows.append({"version": v, "delta_mib": held.delta_bytes / 2**20, "add_s": add_s, "switch_to_v0_s": switch_s})
        print(f"v{v}: deltas of {v} versions {rows[-1]['delta_mib']:.1f} MiB (model {model_bytes / 2**20:.1f} MiB), "
              f"add {add_s:.2f} s, switch to v0 {switch_s:.3f} s", flush=True)
    whole = args.versions * model_bytes / 2**20
    print(json.dumps({"params_m": cfg.num_parameters() / 1e6, "model_mib": model_bytes / 2**20, "versions": rows,
                      "whole_models_mib": whole, "deltas_over_whole": rows[-1]["delta_mib"] / whole}))


if __name__ == "__main__":
    main()
