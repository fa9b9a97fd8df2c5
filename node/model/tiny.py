"""The tiny MoE's shape: the one home of its defaults and bounds (torch-free: the coordinator checks a
recipe's shape with these fields and never imports torch).

The recipe (`node.recipe.Recipe`) carries the same fields so a run's operator sets them in `[recipe]`;
`train-local` takes them too; each reads default and bounds from here.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from node.model.config import ModelConfig

TINY_MAX_SEQ = 64
"""Sequence limit of the tiny MoE (its tasks' prompts and answers are a few characters)."""


class TinyMoE(BaseModel):
    """The randomly initialised tiny MoE of tests and the default sim (character tokenizer)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    hidden: int = Field(64, ge=8, le=65_536)
    """Model width of the tiny MoE (head_dim = hidden / 4; vLLM's CPU attention needs >= 128)."""
    layers: int = Field(2, ge=1, le=256)
    """Decoder layers."""
    experts: int = Field(4, ge=1, le=256)
    """Routed experts per MoE layer."""
    top_k: int = Field(2, ge=1, le=256)
    """Experts each token is routed to."""
    seed: int = Field(0, ge=0, lt=1 << 63)
    """torch seed of the random initialisation (every member draws the same weights)."""

    def config(self, vocab_size: int) -> ModelConfig:
        """The architecture of this shape over a `vocab_size`-token vocabulary."""
        return ModelConfig(vocab_size=vocab_size, hidden_size=self.hidden, intermediate_size=2 * self.hidden,
                           moe_intermediate_size=self.hidden, num_hidden_layers=self.layers, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=self.hidden // 4, num_experts=self.experts,
                           num_experts_per_tok=self.top_k, max_position_embeddings=TINY_MAX_SEQ)


SHAPE = ("hidden", "layers", "experts", "top_k")
"""The fields that shape the model (the seed only draws its weights)."""
