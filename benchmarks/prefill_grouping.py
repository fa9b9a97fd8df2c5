"""The validator's recomputation of a long-tailed round, its sequences grouped to pad least against the fewest groups:

    python -m benchmarks.prefill_grouping [--shape qwen3-moe-tiny] [--rows 256] [--device cpu] [--out FILE]

Times `node.replay.TorchReference.prefill` (what `verify_claims` calls in the validator role) over `--rows`
sequences of a 60-token prompt and a Pareto-tailed completion (median ~30, at most 960: the batch of
`benchmarks.trainer_profile`), random weights of `--shape` in bf16, with the role's grouping
(`node.model.batching.padded_groups`, `GROUP_OVERHEAD_TOKENS` a group) and with the fewest groups
(`token_budget_groups`, what ran before) under the same padded-token budget, interleaved, best of `--repeat`.
The peer is the fewest-groups run in the same process. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import node.replay as replay
from benchmarks import emit
from benchmarks.random_checkpoint import SHAPES
from node.model.batching import GROUP_OVERHEAD_TOKENS, padded_groups, token_budget_groups
from node.model.config import ModelConfig
from node.model.qwen3_moe import CausalLM


def fewest(lengths, budget, _overhead):
    return token_budget_groups(lengths, budget)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-moe-tiny", choices=list(SHAPES))
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = ModelConfig(**SHAPES[args.shape], vocab_size=1000, max_position_embeddings=1100)
    with torch.device(args.device):
        model = CausalLM(cfg).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    completions = (15 * (1 - torch.rand(args.rows, generator=g)) ** (-1 / 1.1)).clamp(4, 960).long().tolist()
    seqs = [torch.randint(0, 1000, (60 + n,), generator=g).tolist() for n in completions]
    ref = replay.TorchReference({0: (model, b"0" * 32)}, eos_id=0, max_seq_len=1100, decode=lambda ids: "")
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    lengths = [len(s) for s in seqs]
    runs: dict[str, dict] = {}
    try:
        for _ in range(args.repeat):
            for name, grouping in (("fewest_groups", fewest), ("padded_groups", padded_groups)):
                replay.padded_groups = grouping  # what TorchReference._prefill groups with
                sync()
                t = time.perf_counter()
                ref.prefill(0, seqs, logits_from=[59] * len(seqs))
                sync()
                took = time.perf_counter() - t
                groups = grouping(lengths, ref.batch_tokens, GROUP_OVERHEAD_TOKENS)
                row = runs.setdefault(name, {"seconds": took, "groups": len(groups),
                                             "padded_positions": sum(len(x) * max(lengths[i] for i in x) for x in groups)})
                row["seconds"] = round(min(row["seconds"], took), 4)
    finally:
        replay.padded_groups = padded_groups
    return emit({"benchmark": "prefill_grouping", "command": "python -m benchmarks.prefill_grouping "
                 + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
                 "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                 "shape": args.shape, "rows": args.rows, "real_positions": sum(lengths), "batch_tokens": ref.batch_tokens,
                 "overhead_tokens": GROUP_OVERHEAD_TOKENS, **runs,
                 "speedup": round(runs["fewest_groups"]["seconds"] / runs["padded_groups"]["seconds"], 2)}, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
