"""The safetensors files of an HF-layout checkpoint, read one tensor (or one slice) at a time.

Opening reads only the files' headers (names, dtypes, shapes) and checks them against the index and
against each other: a shard the index lists but the directory lacks, a tensor in a file the index
does not place there, a name the index lists that no shard holds, an FP8 weight whose scales do not
fit it. All of it is refused before one tensor's bytes are read, so a bad checkpoint costs no memory.

Invariant: `value(name, dtype)` is the tensor as the model holds it in `dtype`: a block-scaled FP8
weight comes back dequantised (node/model/quantization.py), anything else cast.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from node.model.errors import InvalidCheckpoint, MissingModelFile
from protocol.model_spec import FP8Mode
from node.model.hf_config import read_quantization
from node.model.quantization import SCALE_SUFFIX, BlockFP8, check_scales, dequantize

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_DENSE = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
"""The weights `fp8 = "experts"` quantises, and the decoder projections `"all"` adds (node/engine/fp8/model.py)."""


class CheckpointShards:
    """Handles on every shard of `directory` (memory-mapped; nothing read until asked)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.quantization: BlockFP8 | None = read_quantization(self.directory)
        """Block-scaled FP8 when config.json says so (its `weight_scale_inv` tensors are then checked)."""
        self._file_of: dict[str, str] = {}
        self._handles: dict[str, object] = {}
        weight_map = self._weight_map()
        files = sorted(set(weight_map.values())) if weight_map is not None else [WEIGHTS]
        for fname in files:
            path = self.directory / fname
            if not path.exists():
                raise MissingModelFile(f"{path} is missing (listed in {INDEX}); copy the complete checkpoint")
            try:
                handle = safe_open(str(path), framework="pt")
            except (OSError, SafetensorError) as exc:
                raise InvalidCheckpoint(f"cannot read weights {path}: {exc}") from exc
            self._handles[fname] = handle
            names = list(handle.keys())
            if weight_map is not None:
                stray = [n for n in names if weight_map.get(n) != fname]
                if stray:
                    raise InvalidCheckpoint(f"{path}: tensors {stray[:3]} are not listed for this file in {INDEX}")
            self._file_of.update(dict.fromkeys(names, fname))
        if weight_map is not None and set(weight_map) - set(self._file_of):
            raise InvalidCheckpoint(f"{INDEX} lists tensors no shard holds: {sorted(set(weight_map) - set(self._file_of))[:3]}")
        self._check_scales()

    def _weight_map(self) -> dict[str, str] | None:
        index = self.directory / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise TypeError("weight_map must map tensor names to file names")
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
                raise InvalidCheckpoint(f"{index}: not a safetensors index ({exc})") from exc
            bad = [f for f in set(weight_map.values()) if Path(f).name != f]
            if bad:
                raise InvalidCheckpoint(f"{index}: shard names {bad[:3]} are not plain file names")
            return weight_map
        if (self.directory / WEIGHTS).exists():
            return None
        raise MissingModelFile(f"{self.directory}: neither {WEIGHTS} nor {INDEX} is there; a model directory needs its "
                               "weights as safetensors (convert .bin/.pt checkpoints with transformers' save_pretrained)")

    def _check_scales(self) -> None:
        scales = {n for n in self._file_of if n.endswith(SCALE_SUFFIX)}
        if scales and self.quantization is None:
            raise InvalidCheckpoint(f"{self.directory}: tensors {sorted(scales)[:2]} are FP8 scales but config.json "
                                    "has no quantization_config")
        for scale in scales:
            weight = scale.removesuffix(SCALE_SUFFIX)
            if weight not in self._file_of:
                raise InvalidCheckpoint(f"{scale}: scales of {weight}, which the checkpoint does not hold")
            check_scales(weight, self.shape(weight), self._dtype(weight), self.shape(scale), self._dtype(scale))
        for name in self._file_of:
            if self._dtype(name) == "F8_E4M3" and name + SCALE_SUFFIX not in scales:
                check_scales(name, self.shape(name), "F8_E4M3", None, None)

    # ---- what is there -----------------------------------------------------------------
    def names(self) -> list[str]:
        """Tensor names as the model sees them (scale tensors belong to their weights)."""
        return sorted(n for n in self._file_of if not n.endswith(SCALE_SUFFIX))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def _dtype(self, name: str) -> str:
        return self._slice(name).get_dtype()

    def is_fp8(self, name: str) -> bool:
        """Whether `name` is stored as block-scaled e4m3 (with `name + "_scale_inv"`)."""
        return name + SCALE_SUFFIX in self._file_of

    def _slice(self, name: str):  # noqa: ANN202 (safetensors' PySafeSlice)
        try:
            return self._handles[self._file_of[name]].get_slice(name)
        except KeyError:
            raise InvalidCheckpoint(f"{self.directory}: tensor {name} is missing") from None

    def fp8_mode(self) -> FP8Mode:
        """The serving precision the checkpoint is stored in: `all` when every expert and decoder projection
        is block-scaled e4m3, `experts` when the routed experts are, else `off` (served as dequantised)."""
        experts = [n for n in self.names() if _EXPERT.match(n)]
        dense = [n for n in self.names() if _DENSE.match(n)]
        if experts + dense and all(self.is_fp8(n) for n in experts + dense):
            return "all"
        return "experts" if experts and all(self.is_fp8(n) for n in experts) else "off"

    # ---- reading -----------------------------------------------------------------------
    def raw(self, name: str) -> torch.Tensor:
        """The tensor exactly as stored."""
        if name not in self._file_of:
            raise InvalidCheckpoint(f"{self.directory}: tensor {name} is missing")
        return self._handles[self._file_of[name]].get_tensor(name)

    def fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 weight, float32 block scales) of a quantised weight, as stored."""
        return self.raw(name), self.raw(name + SCALE_SUFFIX)

    def value(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor in `dtype`; an FP8 weight dequantised block by block."""
        if self.is_fp8(name):
            return dequantize(*self.fp8(name), dtype)
        t = self.raw(name)
        return t if t.dtype == dtype else t.to(dtype)

    def rows(self, name: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows start:stop (dimension 0) of a plain tensor in `dtype`, reading only those rows' bytes."""
        if self.is_fp8(name):  # scales are per 128 rows: read the whole weight, then cut (rare: trainer on FP8)
            return self.value(name, dtype)[start:stop].contiguous()
        return self._slice(name)[start:stop].to(dtype)
