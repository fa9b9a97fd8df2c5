"""A randomly initialised model of a real architecture's shape, written as an HF-layout directory
(config.json, safetensors, the tokenizer files of another model): throughput runs of real shapes
where the real weights cannot travel (benchmarks.gpu_network on the GPU machine).

    python -m benchmarks.random_checkpoint SHAPE DIR [--tokenizer-from DIR] [--device cuda]

Shapes (`SHAPES`) keep the real model's layer widths, heads and experts; the vocabulary is the
tokenizer's (49,152 with SmolLM2's, where Qwen3's is 151,936: the embeddings are the only difference).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from node.model.checkpoint import save_checkpoint
from node.model.config import ModelConfig
from node.model.qwen3_moe import CausalLM

QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1_000_000.0)
SHAPES: dict[str, dict] = {
    "qwen3-30b-a3b-8l": {**QWEN3_30B_A3B, "num_hidden_layers": 8},
    "qwen3-30b-a3b-2l": {**QWEN3_30B_A3B, "num_hidden_layers": 2},
    "qwen3-moe-small": dict(model_type="qwen3_moe", hidden_size=1024, intermediate_size=3072, moe_intermediate_size=512,
                            num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
                            num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=8),
    "qwen3-moe-tiny": dict(model_type="qwen3_moe", hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                           num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2),
}


def write_random(shape: str, directory: Path, tokenizer_from: Path, vocab_size: int, max_seq_len: int = 512,
                 device: str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """Write SHAPES[shape] with N(0, 0.02) weights (norms 1) to `directory`; returns it."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cfg = ModelConfig(**SHAPES[shape], vocab_size=vocab_size, max_position_embeddings=max_seq_len)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model = model.to(dtype).cpu()
    return save_checkpoint(model, directory, companions_from=tokenizer_from, max_shard_bytes=4 << 30)


def params_b(shape: str, vocab_size: int) -> float:
    with torch.device("meta"):
        model = CausalLM(ModelConfig(**SHAPES[shape], vocab_size=vocab_size))
    return sum(p.numel() for p in model.parameters()) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=list(SHAPES))
    p.add_argument("directory", type=Path)
    p.add_argument("--tokenizer-from", type=Path, default=None, help="default: the SmolLM2 directory")
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    if args.tokenizer_from is None:
        from node.model.pretrained import smollm2_dir
        args.tokenizer_from = smollm2_dir()
    print(write_random(args.shape, args.directory, args.tokenizer_from, args.vocab_size, device=args.device))


if __name__ == "__main__":
    main()
