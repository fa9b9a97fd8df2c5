"""FP8 e4m3 quantisation in the DeepSeek-V3 layout, in plain torch (any device).

Invariant: `dequantize(*quantize_x(t))` reproduces `t` to within e4m3's relative step (2^-3
of the largest element of each block at worst, usually far less), and every scale is a positive
finite float32, so a block of zeros never produces NaN.

Two granularities, both along the contraction dimension K (the last one):
- weights [..., N, K]: one scale per 128x128 block -> scales [..., ceil(N/128), ceil(K/128)].
  A 128x128 block layout is symmetric, so the transpose of a quantised weight is the quantised
  transpose (the trainer's backward pass uses this).
- activations [M, K]: one scale per row per 128-channel group -> scales [M, ceil(K/128)].
Shapes need not be multiples of 128: the last block is partial and the kernels mask it.
The Triton fast path for activations lives in `triton_kernels.py`; this module is the reference.
"""

from __future__ import annotations

import torch

BLOCK = 128
"""Block edge of weight scales and group width of activation scales (DeepSeek-V3)."""

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite e4m3fn value."""

_MIN_AMAX = 1e-12
"""Floor on a block's absolute maximum, so an all-zero block gets a finite scale."""


class UnsupportedTensor(ValueError):
    """A tensor the FP8 path cannot take (wrong rank or dtype); the caller keeps the bf16 path."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _over_fp8_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 as a true division on every device. Divided by a Python number, torch's CUDA kernel
    multiplies by the reciprocal instead (one bit less exact; the CPU divides): on 1M random values the two
    differed in 54% of the results, so a CPU validator and a GPU node quantising the same weights held
    different scales, and e4m3 bytes that differed wherever a weight sat near a rounding midpoint. A divisor
    that is a tensor on `amax`'s device takes the true division there too."""
    return amax / amax.new_full((), FP8_MAX)


def quantize_weight(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise w [..., N, K] with one float32 scale per block x block tile."""
    if w.dim() < 2 or not w.is_floating_point():
        raise UnsupportedTensor(f"weight must be a float tensor of rank >= 2, got {tuple(w.shape)} {w.dtype}")
    *lead, n, k = w.shape
    nb, kb = _cdiv(n, block), _cdiv(k, block)
    if n % block or k % block:  # a partial last block: zero-padded to whole tiles
        padded = torch.zeros(*lead, nb * block, kb * block, dtype=torch.float32, device=w.device)
        padded[..., :n, :k] = w.float()
    else:  # whole tiles (every real checkpoint's shapes): no padded copy
        padded = w.float()
    tiles = padded.reshape(*lead, nb, block, kb, block)
    amax = tiles.abs().amax(dim=(-3, -1)).clamp_min(_MIN_AMAX)  # [..., nb, kb]
    scale = _over_fp8_max(amax)
    q = (tiles / scale[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(*lead, nb * block, kb * block)[..., :n, :k].contiguous()
    return q, scale.contiguous()


def quantize_act(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise x [M, K] with one float32 scale per row per `group` channels."""
    if x.dim() != 2 or not x.is_floating_point():
        raise UnsupportedTensor(f"activation must be a 2-D float tensor, got {tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    kb = _cdiv(k, group)
    padded = torch.zeros(m, kb * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    groups = padded.view(m, kb, group)
    scale = _over_fp8_max(groups.abs().amax(dim=-1).clamp_min(_MIN_AMAX))  # [M, kb]
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, kb * group)[:, :k].contiguous(), scale.contiguous()


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Inverse of `quantize_weight`, in float32."""
    n, k = q.shape[-2:]
    s = scale.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :n, :k]
    return q.float() * s


def dequantize_act(q: torch.Tensor, scale: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """Inverse of `quantize_act`, in float32."""
    k = q.shape[-1]
    return q.float() * scale.repeat_interleave(group, dim=-1)[:, :k]


def reference_gemm(
    a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor, b_group_n: int = BLOCK
) -> torch.Tensor:
    """a [M, K] (row groups) times b [N, K]^T (blocks, or row groups when b_group_n == 1), float32.

    The same function the Triton kernel computes, written for clarity; the CPU path uses it.
    """
    a = dequantize_act(a_q, a_s)
    if b_group_n == 1:
        b = dequantize_act(b_q, b_s)
    else:
        b = dequantize_weight(b_q, b_s, b_group_n)
    return a @ b.t()
