"""The hash of a model's weights (`ModelSpec.weights_hash`), built tensor by tensor in any order.

`blake3:` over one line per HF-named tensor, in name order: `name|dtype|shape|blake3(bytes)`. The
per-tensor digests are taken as tensors arrive (a loader fills the model module by module, never in
name order), so the whole model never has to exist in one place to be hashed. A block-scaled FP8
tensor is hashed as its dequantised value in the model's dtype, so an FP8 checkpoint's bf16 model
and its FP8-served twin agree (node/model/quantization.py).
"""

from __future__ import annotations

import math

import blake3
import numpy as np
import torch

from node.model.errors import InvalidCheckpoint


def tensor_hexdigest(t: torch.Tensor) -> str:
    """blake3 hex digest of a host tensor's bytes, as a weights digest records each tensor."""
    return blake3.blake3(t.contiguous().reshape(-1).view(torch.uint8).numpy(), max_threads=blake3.blake3.AUTO).hexdigest()


class WeightsDigest:
    """Per-tensor digests, combined into the model's hash once every tensor was added."""

    def __init__(self) -> None:
        self._lines: dict[str, str] = {}
        self.tensor_hashes: dict[str, str] = {}
        """name -> blake3 hex digest of that tensor's bytes."""

    def add(self, name: str, t: torch.Tensor) -> None:
        """Record HF-named tensor `name` (its value as the model holds it); adding a name twice keeps the first."""
        if name in self._lines:
            return
        t = t.detach().cpu()
        self.add_hashed(name, t.dtype, tuple(t.shape), tensor_hexdigest(t))

    def add_hashed(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], hexdigest: str) -> None:
        """Record `name` by the blake3 hex digest of its bytes (hashed elsewhere, piece by piece)."""
        if name not in self._lines:
            self._lines[name] = f"{name}|{dtype}|{tuple(shape)}|{hexdigest}\n"
            self.tensor_hashes[name] = hexdigest

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


class DigestingReads:
    """A `shardcast.codec.TensorBytes` whose reads also add each tensor to `digest` when they cover it
    from its first byte to its last, in order (as the manifest check reads a version): the check
    against the signed manifest and the spec's pin are then one pass over the checkpoint. A tensor
    read otherwise is not added (`hexdigest(expected=...)` then names it)."""

    def __init__(self, source, digest: WeightsDigest):  # noqa: ANN001 (a TensorBytes)
        self.source, self.digest = source, digest
        self._open: dict[str, tuple[blake3.blake3, int]] = {}

    def names(self) -> set[str]:
        return self.source.names()

    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        return self.source.header(name)

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        got = self.source.read(name, lo, hi)
        h, at = self._open.pop(name, (None, 0))
        if lo == 0:
            h, at = blake3.blake3(max_threads=blake3.blake3.AUTO), 0
        if h is None or lo != at:
            return got  # not read in order: never added
        h.update(got)
        dtype_name, shape = self.source.header(name)
        dtype = getattr(torch, dtype_name)
        if hi == math.prod(shape) * dtype.itemsize:
            self.digest.add_hashed(name, dtype, shape, h.hexdigest())
        else:
            self._open[name] = (h, hi)
        return got
