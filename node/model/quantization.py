"""Quantised checkpoints: which `quantization_config` we load, and how its tensors become ours.

Only block-scaled FP8 in the Hugging Face / DeepSeek-V3 layout is loaded: `quant_method "fp8"`,
`fmt "e4m3"`, `weight_block_size [128, 128]`, dynamic activation scales. Each quantised projection
`X.weight` is float8_e4m3fn [out, in] beside `X.weight_scale_inv`, float32 [ceil(out/128),
ceil(in/128)], and the weight is `weight * weight_scale_inv` block by block. That is exactly our FP8
modules' layout (node/fp8/quantize.py: scale = amax / 448 per 128 x 128 tile of [N, K], dequantised
as q x scale), so a checkpoint's e4m3 bytes and scales go into `FP8Linear` / `FP8GroupedExperts` as
they are; only expert pairs whose gate rows do not end on a block edge are requantised once stacked.

Invariant: a quantised tensor's value, wherever it ends up, is `dequantize(weight, scale_inv)`: the
bf16 model of an FP8 checkpoint and its FP8-served twin hash the same (node/model/spec.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from node.model.errors import MismatchedScales, UnsupportedQuantization

BLOCK = 128
"""Edge of a weight's scale block: the checkpoints' `weight_block_size` and node/fp8's block (a test pins
that they agree; the model package imports nothing above it)."""

SCALE_SUFFIX = "_scale_inv"
"""`X.weight_scale_inv` holds the block scales of `X.weight`."""
_KNOWN_FIELDS = {"quant_method", "fmt", "weight_block_size", "activation_scheme", "modules_to_not_convert",
                 "ignored_layers"}
"""Fields of an FP8 `quantization_config`; `modules_to_not_convert` / `ignored_layers` are informational
(a weight is quantised exactly when its scale tensor is there)."""


@dataclass(frozen=True)
class BlockFP8:
    """A checkpoint stored as block-scaled e4m3 (the only quantised layout loaded)."""

    block: int = BLOCK


def block_fp8_of(qc: object, where: str = "config.json") -> BlockFP8:
    """The checkpoint's FP8 layout from its `quantization_config`, or `UnsupportedQuantization` naming
    what differs (another method: int4, GPTQ, AWQ, bitsandbytes...; another block size or format)."""
    if not isinstance(qc, dict):
        raise UnsupportedQuantization(f"{where}: quantization_config must be an object, not {qc!r}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise UnsupportedQuantization(f"{where}: quantization_config quant_method {method!r} is not loaded (only "
                                      "block-scaled fp8 e4m3, 128x128); save a bfloat16 copy of the model first")
    unknown = sorted(set(qc) - _KNOWN_FIELDS)
    if unknown:
        raise UnsupportedQuantization(f"{where}: quantization_config fields {unknown} are not implemented for fp8")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedQuantization(f"{where}: fp8 fmt {qc['fmt']!r} is not loaded (only e4m3)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedQuantization(f"{where}: fp8 activation_scheme {qc['activation_scheme']!r} is not loaded "
                                      "(only dynamic: activations are quantised per token per 128 channels)")
    if qc.get("weight_block_size") != [BLOCK, BLOCK]:
        raise UnsupportedQuantization(f"{where}: fp8 weight_block_size {qc.get('weight_block_size')!r} is not "
                                      f"supported (only [{BLOCK}, {BLOCK}], the block our FP8 kernels use)")
    return BlockFP8()


def scale_shape(weight_shape: tuple[int, ...], block: int = BLOCK) -> tuple[int, ...]:
    """The scale tensor a weight [..., N, K] must come with: [..., ceil(N/block), ceil(K/block)]."""
    *lead, n, k = weight_shape
    return (*lead, -(-n // block), -(-k // block))


def check_scales(name: str, weight_shape: tuple[int, ...], weight_dtype: str, scale_shape_: tuple[int, ...] | None,
                 scale_dtype: str | None) -> None:
    """`MismatchedScales` unless `name` is e4m3 with a float32 scale tensor of the block shape."""
    if scale_shape_ is None:
        raise MismatchedScales(f"{name}: stored as {weight_dtype} but {name}{SCALE_SUFFIX} is missing")
    if weight_dtype != "F8_E4M3":
        raise MismatchedScales(f"{name}: has {name}{SCALE_SUFFIX} but is {weight_dtype}, not float8_e4m3fn")
    if scale_dtype != "F32":
        raise MismatchedScales(f"{name}{SCALE_SUFFIX}: dtype {scale_dtype}, expected float32")
    want = scale_shape(weight_shape)
    if tuple(scale_shape_) != want:
        raise MismatchedScales(f"{name}{SCALE_SUFFIX}: shape {tuple(scale_shape_)} does not fit the weight "
                               f"{tuple(weight_shape)} in 128x128 blocks (expected {want})")


_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
"""Every e4m3 byte's float32 value (exact: e4m3 is a subset of float32), indexed by the byte."""


def e4m3_to_float32(q: torch.Tensor) -> torch.Tensor:
    """`q.float()`, bit for bit. On the CPU through a 256-entry table: torch's own float8 cast there is
    scalar (5.7 ms for one Qwen3-30B-A3B expert projection, 768 x 2048, on one core of cpu-2core; the
    table 2.5 ms for the whole dequantisation), and a 30B FP8 checkpoint's load dequantises 18,432 of them
    to hash their values."""
    if q.device.type != "cpu":
        return q.float()
    return torch.from_numpy(np.take(_E4M3_VALUES, q.contiguous().view(torch.uint8).numpy()))


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`q x scale_inv` block by block, in `dtype`: bit for bit what an FP8 module's state_dict gives."""
    *lead, n, k = q.shape
    nb, kb = scale_inv.shape[-2:]
    if n % BLOCK or k % BLOCK:  # a partial last block: pad, multiply, cut (the same products)
        padded = q.new_zeros(*lead, nb * BLOCK, kb * BLOCK, dtype=torch.float32)
        padded[..., :n, :k] = e4m3_to_float32(q)
        tiles = padded.view(*lead, nb, BLOCK, kb, BLOCK).mul_(scale_inv[..., :, None, :, None])
        return tiles.view(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k].to(dtype)
    tiles = e4m3_to_float32(q).view(*lead, nb, BLOCK, kb, BLOCK).mul_(scale_inv[..., :, None, :, None])
    return tiles.view(*lead, n, k).to(dtype)
