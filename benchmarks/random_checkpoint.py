"""A randomly initialised model of a real architecture's shape, written as an HF-layout directory
(config.json, safetensors, the tokenizer files of another model): throughput runs of real shapes
where the real weights cannot travel (benchmarks.gpu_network on the GPU machine).

    python -m benchmarks.random_checkpoint SHAPE DIR [--tokenizer-from DIR] [--device cuda]
        [--fp8 experts|all] [--vocab-size N] [--shard-gib 4]

Shapes (`SHAPES`) keep the real model's layer widths, heads and experts; the vocabulary is the
tokenizer's (49,152 with SmolLM2's, where Qwen3's is 151,936: the embeddings are the only difference).
`qwen3-30b-a3b` is the full 48-layer model (30.5B parameters with Qwen3's vocabulary).

With `--fp8` the checkpoint is block-scaled FP8 in the Hugging Face / DeepSeek layout (config.json's
`quantization_config`, e4m3 `*.weight` with float32 `*.weight_scale_inv` per 128x128 block) for the
routed experts (`experts`) or every decoder projection too (`all`): ~31 GB for the full 30B shape.
Tensors are drawn, quantised and written one shard at a time (`write_random_shards`): the process
never holds more than one shard, whatever the model's size.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from node.fp8.quantize import BLOCK, quantize_weight
from node.model.checkpoint import CONFIG, INDEX, copy_companions
from node.model.config import ModelConfig
from node.model.fill import checkpoint_shapes, meta_model
from node.model.qwen3_moe import CausalLM

QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1_000_000.0)
SHAPES: dict[str, dict] = {
    "qwen3-30b-a3b": {**QWEN3_30B_A3B, "num_hidden_layers": 48},
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
                 device: str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0, fp8: str = "off") -> Path:
    """Write SHAPES[shape] with N(0, 0.02) weights (norms 1) to `directory`, shard by shard; returns it."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cfg = ModelConfig(**SHAPES[shape], vocab_size=vocab_size, max_position_embeddings=max_seq_len)
    return write_random_shards(cfg, directory, fp8, dtype, device, seed, tokenizer_from=tokenizer_from)


_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_DENSE = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def quantised_in(fp8: str, name: str) -> bool:
    """Whether `name` is stored as block-scaled e4m3 in a checkpoint of FP8 mode `fp8` (the weights the
    engine's `apply_fp8_mode` quantises: routed experts; with `all` the decoder projections too)."""
    return fp8 != "off" and bool(_EXPERT.match(name) or (fp8 == "all" and _DENSE.match(name)))


def write_random_shards(cfg: ModelConfig, directory: Path, fp8: str = "off", dtype: torch.dtype = torch.bfloat16,
                        device: str = "cpu", seed: int = 0, max_shard_bytes: int = 4 << 30,
                        tokenizer_from: Path | None = None) -> Path:
    """Write a random `cfg` model to `directory` tensor by tensor (N(0, 0.02), norms 1), `fp8` ("off",
    "experts", "all") choosing which weights are stored block-scaled e4m3; at most one shard in memory."""
    directory.mkdir(parents=True, exist_ok=True)
    shapes = checkpoint_shapes(meta_model(cfg, dtype))
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    files: list[list[str]] = []
    total = 0

    def flush() -> None:
        files.append(list(shard))
        save_file(shard, str(directory / f"part-{len(files):05d}.safetensors"), metadata={"format": "pt"})
        shard.clear()

    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            tensors = {name: torch.ones(shapes[name], dtype=dtype)}
        else:
            w = torch.empty(shapes[name], dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=gen)
            if quantised_in(fp8, name):
                q, s = quantize_weight(w)
                tensors = {name: q.cpu(), name + "_scale_inv": s.cpu()}
            else:
                tensors = {name: w.to(dtype).cpu()}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if shard and sum(t.numel() * t.element_size() for t in shard.values()) + nbytes > max_shard_bytes:
            flush()
        shard.update(tensors)
        total += nbytes
    flush()
    for i, names in enumerate(files):  # final names say how many shards there are, as HF's do
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (directory / f"part-{i + 1:05d}.safetensors").rename(directory / final)
        weight_map.update(dict.fromkeys(names, final))
    config = cfg.to_hf_dict(str(dtype).removeprefix("torch."))
    if fp8 != "off":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [BLOCK, BLOCK]}
    (directory / CONFIG).write_text(json.dumps(config, indent=2))
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if tokenizer_from is not None:
        copy_companions(tokenizer_from, directory)
    return directory


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
    p.add_argument("--fp8", choices=["off", "experts", "all"], default="off",
                   help="store the experts (or every decoder projection) as block-scaled e4m3")
    p.add_argument("--max-seq-len", type=int, default=40960)
    p.add_argument("--shard-gib", type=float, default=4.0)
    args = p.parse_args()
    if args.tokenizer_from is None:
        from node.model.pretrained import smollm2_dir
        args.tokenizer_from = smollm2_dir()
    cfg = ModelConfig(**SHAPES[args.shape], vocab_size=args.vocab_size, max_position_embeddings=args.max_seq_len)
    print(write_random_shards(cfg, args.directory, args.fp8, device=args.device, tokenizer_from=args.tokenizer_from,
                              max_shard_bytes=int(args.shard_gib * 2**30)))


if __name__ == "__main__":
    main()
