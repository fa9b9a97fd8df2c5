"""Model configuration: one typed description of the causal LM, read from and written to HF config.json.

`model_type` decides the layout: `qwen3_moe` (routed experts, per-head q/k RMSNorm), `qwen3`
(dense, q/k norm), `llama` (dense, no q/k norm). Fields a layout does not have are fixed by it
(a llama has no experts and no q/k norm); a contradiction is an error, never a silent default.
Reading a config.json goes through `node/model/hf_config.py`, which maps every HF field to one
of these or refuses it by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from node.model.errors import ModelLoadError

ModelType = Literal["qwen3_moe", "qwen3", "llama"]


class InvalidModelConfig(ModelLoadError):
    """A config.json that does not describe a model we can build."""


class RopeScaling(BaseModel):
    """A rotary frequency schedule other than the default (see node/model/rope.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rope_type: Literal["linear", "llama3"]
    """Schedule name as in HF's `rope_scaling.rope_type`."""
    factor: float = Field(gt=0)
    """Context extension factor."""
    low_freq_factor: float = Field(1.0, gt=0)
    """llama3: wavelengths above original_max / low_freq_factor are divided by `factor`."""
    high_freq_factor: float = Field(4.0, gt=0)
    """llama3: wavelengths below original_max / high_freq_factor are kept."""
    original_max_position_embeddings: int = Field(8192, ge=1)
    """llama3: context length the model was pretrained with."""


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_type: ModelType = "qwen3_moe"
    """HF model type written to config.json."""
    vocab_size: int = Field(128, ge=2)
    """Number of token ids (rows of the embedding)."""
    hidden_size: int = Field(64, ge=1)
    """Width of the residual stream."""
    intermediate_size: int = Field(128, ge=1)
    """Width of dense MLP layers."""
    moe_intermediate_size: int = Field(64, ge=1)
    """Width of each expert's MLP (qwen3_moe)."""
    num_hidden_layers: int = Field(2, ge=1)
    """Number of decoder layers."""
    num_attention_heads: int = Field(4, ge=1)
    """Query heads."""
    num_key_value_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention); divides num_attention_heads."""
    head_dim: int = Field(16, ge=2)
    """Width of one attention head (even, for rotary embeddings)."""
    num_experts: int = Field(4, ge=0)
    """Routed experts per MoE layer; 0 for the dense layouts (qwen3, llama), > 0 for qwen3_moe."""
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
    rope_scaling: RopeScaling | None = None
    """Rotary frequency schedule; None is the default schedule."""
    max_position_embeddings: int = Field(512, ge=1)
    """Longest sequence the model was trained for (engines size their KV cache by their own limit)."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the LM head."""
    router_aux_loss_coef: float = Field(0.001, ge=0)
    """Weight of the load-balancing auxiliary loss."""
    qk_norm: bool = True
    """Per-head RMSNorm on queries and keys; fixed by model_type (qwen3*: yes, llama: no)."""
    hidden_act: Literal["silu"] = "silu"
    """MLP activation."""
    attention_bias: Literal[False] = False
    """Bias on q/k/v/o projections (only False is built)."""

    @model_validator(mode="before")
    @classmethod
    def _layout_defaults(cls, data):
        """Fields a layout fixes default to the layout's value when not given."""
        if isinstance(data, dict):
            data = dict(data)
            kind = data.get("model_type", "qwen3_moe")
            data.setdefault("qk_norm", kind != "llama")
            if kind != "qwen3_moe":
                data.setdefault("num_experts", 0)
        return data

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_key_value_heads must divide num_attention_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError("num_experts_per_tok exceeds num_experts")
        if self.model_type == "qwen3_moe" and self.num_experts == 0:
            raise ValueError("model_type qwen3_moe needs num_experts > 0 (use model_type qwen3 for a dense model)")
        if self.model_type != "qwen3_moe" and self.num_experts:
            raise ValueError(f"model_type {self.model_type} is dense: num_experts must be 0")
        if self.qk_norm != (self.model_type != "llama"):
            raise ValueError(f"model_type {self.model_type} fixes qk_norm={self.model_type != 'llama'}")
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

    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once), computed from the config alone."""
        h, attn = self.hidden_size, self.hidden_size * self.head_dim * 2 * (self.num_attention_heads + self.num_key_value_heads)
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for i in range(self.num_hidden_layers):
            mlp = (self.num_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
                   if self.is_moe_layer(i) else 3 * h * self.intermediate_size)
            total += attn + norms + mlp
        return total

    def to_hf_dict(self, dtype: str = "float32") -> dict:
        """config.json as `transformers` (and vLLM) read it for this model_type."""
        from node.model.hf_config import config_to_hf

        return config_to_hf(self, dtype)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        from node.model.hf_config import read_config

        return read_config(Path(path))
