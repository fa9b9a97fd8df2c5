"""A model's HF-named tensors read from its checkpoint when asked, one at a time: a policy version
that roles load exactly as they load a fetched one (a mapping of name -> tensor), with no tensor held.

A fetched version is views over its payload file's mapping; this one reads each tensor from the
checkpoint's memory-mapped safetensors files in the model's dtype (cast, or an FP8 weight dequantised:
node/model/shards.py) each time it is looked up, so a loader that copies tensor by tensor
(node/engine/weight_staging.py) holds one tensor beyond the mapping at a time. Its index (`headers`)
comes from the files' headers, so a version is checked whole without one byte of weights read, and
`read` gives a byte range of one tensor's value reading only the rows it spans, so a check can hash
the version shard by shard (`shardcast.codec.matches_manifest`).

Invariant: `weights[name]` is the tensor `build_from_shards` fills the model with (the same values in
the same dtype), and `read(name, lo, hi)` is bytes lo:hi of it; once `pin`ned by a check, a lookup is
the bytes the check read or an error (the files are read again after the check).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from node.model.config import ModelConfig
from node.model.errors import InvalidCheckpoint
from node.model.fill import check_against, checkpoint_shapes, meta_model
from node.model.shards import CheckpointShards
from node.model.weights_digest import tensor_hexdigest


class IndexedTensors(Mapping):
    """Tensors by name that know each one's shape and dtype without reading it (`index`), and read a
    tensor when it is looked up: a version a loader takes tensor by tensor."""

    index: dict[str, tuple[tuple[int, ...], torch.dtype]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


class StreamedWeights(IndexedTensors):
    """HF name -> the tensor in the model's dtype, read from `shards` at each lookup (in `shapes`' order)."""

    def __init__(self, shards: CheckpointShards, dtype: torch.dtype, shapes: dict[str, tuple[int, ...]]):
        self.shards, self.dtype, self.shapes = shards, dtype, shapes
        self.index = {name: (shape, dtype) for name, shape in shapes.items()}
        self.checked: dict[str, str] | None = None
        """name -> blake3 hex of the bytes a check read (`pin`): each lookup is then hashed against it."""

    def pin(self, tensor_hashes: dict[str, str]) -> StreamedWeights:
        """Every later lookup must be the bytes a check read (blake3 per tensor; InvalidCheckpoint naming the
        tensor otherwise): the files are read again after the check, and what is served is what was checked."""
        if set(tensor_hashes) != set(self.shapes):
            raise InvalidCheckpoint(f"{self.shards.directory}: a check hashed other tensors than the version holds")
        self.checked = dict(tensor_hashes)
        return self

    @classmethod
    def of_checkpoint(cls, directory: str | Path, cfg: ModelConfig, dtype: torch.dtype) -> StreamedWeights:
        """The tensors `cfg`'s model reads from `directory`, checked from the files' headers (InvalidCheckpoint
        naming what is missing, unexpected or mis-shaped); no weight is read."""
        shards = CheckpointShards(directory)
        shapes = checkpoint_shapes(meta_model(cfg, dtype))
        check_against(shards, shapes, cfg.tie_word_embeddings)
        return cls(shards, dtype, shapes)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        t = self.shards.value(name, self.dtype)
        if self.checked is not None:
            if tensor_hexdigest(t) != self.checked[name]:
                raise InvalidCheckpoint(f"{self.shards.directory}: {name} changed on disk since it was checked")
        return t

    # ---- what a check reads -----------------------------------------------------------------
    def names(self) -> set[str]:
        return set(self.shapes)

    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype name as a manifest writes it, shape) of `name`, from the index."""
        return str(self.dtype).removeprefix("torch."), self.shapes[name]

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Bytes lo:hi of `name`'s value (uint8), reading only the rows they span (a block-scaled FP8
        weight is dequantised whole: its scales cover 128 rows; it is one projection)."""
        shape = self.shapes[name]
        if len(shape) < 2 or self.shards.is_fp8(name):
            t, at = self.shards.value(name, self.dtype), 0
        else:
            row = math.prod(shape[1:]) * self.dtype.itemsize
            first = lo // row
            t, at = self.shards.rows(name, first, -(-hi // row), self.dtype), first * row
        flat = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        return flat[lo - at : hi - at]


def headers(state: Mapping) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every tensor of a version: a streamed one's from its index (nothing read),
    a fetched one's from its tensors (views: nothing copied)."""
    index = getattr(state, "index", None)  # IndexedTensors, or a fetched payload's (shardcast.fetch.PayloadTensors)
    if isinstance(index, dict):
        return index
    return {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
