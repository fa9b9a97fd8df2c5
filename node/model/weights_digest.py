"""The hash of a model's weights (`ModelSpec.weights_hash`), built tensor by tensor in any order.

`blake3:` over one line per HF-named tensor, in name order: `name|dtype|shape|blake3(bytes)`. The
per-tensor digests are taken as tensors arrive (a loader fills the model module by module, never in
name order), so the whole model never has to exist in one place to be hashed. A block-scaled FP8
tensor is hashed as its dequantised value in the model's dtype, so an FP8 checkpoint's bf16 model
and its FP8-served twin agree (node/model/quantization.py).
"""

from __future__ import annotations

import blake3
import torch

from node.model.errors import InvalidCheckpoint


class WeightsDigest:
    """Per-tensor digests, combined into the model's hash once every tensor was added."""

    def __init__(self) -> None:
        self._lines: dict[str, str] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        """Record HF-named tensor `name` (its value as the model holds it); adding a name twice keeps the first."""
        if name in self._lines:
            return
        t = t.detach().cpu().contiguous()
        h = blake3.blake3(t.reshape(-1).view(torch.uint8).numpy(), max_threads=blake3.blake3.AUTO)
        self._lines[name] = f"{name}|{t.dtype}|{tuple(t.shape)}|{h.hexdigest()}\n"

    def names(self) -> set[str]:
        return set(self._lines)

    def hexdigest(self, expected: set[str] | None = None) -> str:
        """`blake3:<hex>`; with `expected`, refuses (InvalidCheckpoint) unless exactly those names were added."""
        if expected is not None and expected != set(self._lines):
            missing, extra = sorted(expected - set(self._lines)), sorted(set(self._lines) - expected)
            raise InvalidCheckpoint(f"weights hashed do not match the model: missing {missing[:3]}, extra {extra[:3]}")
        h = blake3.blake3()
        for name in sorted(self._lines):
            h.update(self._lines[name].encode())
        return "blake3:" + h.hexdigest()
