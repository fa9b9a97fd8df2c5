"""The check a policy version passes before any engine copies it in: names and shapes of the model.

Checked whole, before one tensor is copied, so a refused version leaves the served weights as they
were and the engine keeps serving the version it has.
"""

from __future__ import annotations

import torch

from node.model.checkpoint import InvalidCheckpoint, hf_to_internal
from node.model.config import ModelConfig
from node.model.qwen3_moe import CausalLM


class WeightsMismatch(InvalidCheckpoint):
    """A policy version whose tensors do not match the served model (names, shapes or dtype kind);
    refused before anything is copied, so the engine keeps serving the version it has."""


def expected_shapes(model: CausalLM) -> dict[str, tuple[int, ...]]:
    """Internal tensor names and shapes of the model as built (before any quantisation), read from a
    meta twin: an FP8 model's state_dict() would dequantise every weight."""
    with torch.device("meta"):
        twin = CausalLM(model.config)
    return {name: tuple(t.shape) for name, t in twin.state_dict().items()}


def check_weights(state_dict: dict[str, torch.Tensor], cfg: ModelConfig,
                  shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """HF-named tensors -> internal names, or `WeightsMismatch` naming what does not fit `shapes`."""
    try:
        internal = hf_to_internal(state_dict, cfg)
    except InvalidCheckpoint as exc:
        raise WeightsMismatch(str(exc)) from exc
    missing = sorted(set(shapes) - set(internal))
    unexpected = sorted(set(internal) - set(shapes))
    if missing or unexpected:
        raise WeightsMismatch(f"missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    for name, t in internal.items():
        if tuple(t.shape) != shapes[name]:
            raise WeightsMismatch(f"{name}: shape {tuple(t.shape)}, the served model has {shapes[name]}")
        if not t.is_floating_point():
            raise WeightsMismatch(f"{name}: dtype {t.dtype} is not a float type")
    return internal
