"""Model configuration with Hugging Face's Qwen3-MoE field names, so config.json round-trips.

`num_experts = 0` gives a dense model (Qwen3 / Llama layout); `qk_norm = False` drops the
per-head RMSNorm on queries and keys (Llama).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class InvalidModelConfig(ValueError):
    """A config.json that does not describe a model we can build."""


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    model_type: Literal["qwen3_moe", "qwen3", "llama"] = "qwen3_moe"
    """HF model type written to config.json."""
    vocab_size: int = Field(128, ge=2)
    """Number of token ids."""
    hidden_size: int = Field(64, ge=1)
    """Width of the residual stream."""
    intermediate_size: int = Field(128, ge=1)
    """Width of dense MLP layers."""
    moe_intermediate_size: int = Field(64, ge=1)
    """Width of each expert's MLP."""
    num_hidden_layers: int = Field(2, ge=1)
    """Number of decoder layers."""
    num_attention_heads: int = Field(4, ge=1)
    """Query heads."""
    num_key_value_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention); divides num_attention_heads."""
    head_dim: int = Field(16, ge=2)
    """Width of one attention head (even, for rotary embeddings)."""
    num_experts: int = Field(4, ge=0)
    """Routed experts per MoE layer; 0 makes every layer dense."""
    num_experts_per_tok: int = Field(2, ge=1)
    """Experts each token is routed to (top-k)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to one."""
    decoder_sparse_step: int = Field(1, ge=1)
    """Every n-th layer is MoE (layer i is MoE when (i + 1) % n == 0)."""
    mlp_only_layers: list[int] = Field(default_factory=list)
    """Layer indices forced dense."""
    rms_norm_eps: float = Field(1e-6, gt=0)
    """RMSNorm epsilon."""
    rope_theta: float = Field(10000.0, gt=0)
    """Rotary embedding base."""
    max_position_embeddings: int = Field(512, ge=1)
    """Longest sequence (prompt + completion) the model is used with."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the LM head."""
    router_aux_loss_coef: float = Field(0.001, ge=0)
    """Weight of the load-balancing auxiliary loss."""
    qk_norm: bool = True
    """Per-head RMSNorm on queries and keys (Qwen3: yes, Llama: no)."""
    hidden_act: Literal["silu"] = "silu"
    """MLP activation."""
    attention_bias: bool = False
    """Bias on q/k/v/o projections (unsupported beyond False)."""

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_key_value_heads must divide num_attention_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError("num_experts_per_tok exceeds num_experts")
        return self

    def is_moe_layer(self, index: int) -> bool:
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layer_indices(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def to_hf_dict(self) -> dict:
        d = self.model_dump()
        d["architectures"] = {
            "qwen3_moe": ["Qwen3MoeForCausalLM"],
            "qwen3": ["Qwen3ForCausalLM"],
            "llama": ["LlamaForCausalLM"],
        }[self.model_type]
        d["torch_dtype"] = "float32"
        d["attention_dropout"] = 0.0
        d["use_sliding_window"] = False
        d["output_router_logits"] = False
        return d

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidModelConfig(f"cannot read model config {path}: {exc}") from exc
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise InvalidModelConfig(f"invalid model config {path}: {exc}") from exc
