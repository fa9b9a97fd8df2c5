"""One Triton kernel per decode layer for rotary embedding of q and k plus the KV-cache write
(the model's ops are about a dozen kernels). Same rounding as `qwen3_moe.rope` in the model's
dtype: x*cos and rotate_half(x)*sin are each rounded to the dtype, then their sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, pos_ptr, qo_ptr, kc_ptr, vc_ptr,
                       stride_qb, stride_kb, stride_vb, stride_cb, stride_cs, stride_cl,
                       NH: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    half = D // 2
    d = tl.arange(0, D)
    partner = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    c = tl.load(cos_ptr + b * stride_cb + d).to(tl.float32)
    s = tl.load(sin_ptr + b * stride_cb + d).to(tl.float32)
    if h < NH:
        src = q_ptr + b * stride_qb + h * D
        x = tl.load(src + d).to(tl.float32)
        xr = tl.load(src + partner).to(tl.float32) * sign
        a = (x * c).to(qo_ptr.dtype.element_ty).to(tl.float32)
        r = (xr * s).to(qo_ptr.dtype.element_ty).to(tl.float32)
        tl.store(qo_ptr + b * stride_qb + h * D + d, (a + r).to(qo_ptr.dtype.element_ty))
    else:
        j = h - NH
        slot = tl.load(slot_ptr + b).to(tl.int64)
        pos = tl.load(pos_ptr + b).to(tl.int64)
        src = k_ptr + b * stride_kb + j * D
        x = tl.load(src + d).to(tl.float32)
        xr = tl.load(src + partner).to(tl.float32) * sign
        a = (x * c).to(kc_ptr.dtype.element_ty).to(tl.float32)
        r = (xr * s).to(kc_ptr.dtype.element_ty).to(tl.float32)
        dst = slot * stride_cs + pos * stride_cl + j * D + d
        tl.store(kc_ptr + dst, (a + r).to(kc_ptr.dtype.element_ty))
        tl.store(vc_ptr + dst, tl.load(v_ptr + b * stride_vb + j * D + d))


def rope_and_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slots: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """q [B, NH, D], k/v [B, NKV, D] (contiguous last two dims), cos/sin [B, D]: writes roped k and v
    at (slots[b], pos[b]) of the [S, L, NKV, D] caches; returns roped q."""
    b, nh, d = q.shape
    nkv = k.shape[1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    qo = torch.empty_like(q)
    _rope_write_kernel[(b, nh + nkv)](q, k, v, cos, sin, slots, pos, qo, k_cache, v_cache,
                                      q.stride(0), k.stride(0), v.stride(0), cos.stride(0),
                                      k_cache.stride(0), k_cache.stride(1), NH=nh, D=d, num_warps=1)
    return qo


@triton.jit
def _norm_rope_row(src, dst, w_ptr, c, s, eps, D: tl.constexpr, NORM: tl.constexpr):
    """One head's row: RMS-normed as `norm_kernels._rms_kernel` norms it (where NORM), then rotated as
    `_rope_write_kernel` rotates; the partner half is loaded (and normed) beside it, no shuffle between lanes."""
    half = D // 2
    d = tl.arange(0, D)
    partner = tl.where(d < half, d + half, d - half)
    x = tl.load(src + d).to(tl.float32)
    xp = tl.load(src + partner).to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
        x = (tl.load(w_ptr + d).to(tl.float32) * (x * rstd).to(dst.dtype.element_ty).to(tl.float32))
        xp = (tl.load(w_ptr + partner).to(tl.float32) * (xp * rstd).to(dst.dtype.element_ty).to(tl.float32))
        x = x.to(dst.dtype.element_ty).to(tl.float32)
        xp = xp.to(dst.dtype.element_ty).to(tl.float32)
    xr = tl.where(d < half, -xp, xp)
    a = (x * c).to(dst.dtype.element_ty).to(tl.float32)
    r = (xr * s).to(dst.dtype.element_ty).to(tl.float32)
    tl.store(dst + d, (a + r).to(dst.dtype.element_ty))


@triton.jit
def _norm_rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr, eps, stride_q, stride_k,
                      NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    c = tl.load(cos_ptr + r * D + d).to(tl.float32)
    s = tl.load(sin_ptr + r * D + d).to(tl.float32)
    if h < NH:
        _norm_rope_row(q_ptr + r * stride_q + h * D, qo_ptr + (r * NH + h) * D, qw_ptr, c, s, eps, D, NORM)
    else:
        j = h - NH
        _norm_rope_row(k_ptr + r * stride_k + j * D, ko_ptr + (r * NKV + j) * D, kw_ptr, c, s, eps, D, NORM)


def norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              norms: tuple[torch.Tensor, torch.Tensor, float] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill's attention prelude after the projections, in one kernel (the model's ops are a dozen): q
    [..., NH, D] and k [..., NKV, D] RMS-normed per head (`norms` = (q weight, k weight, eps); None: no norm) and
    rotated by cos/sin [..., 1, T, D] of the same leading positions (`rope_tables`). Returns new q and k of the
    inputs' shapes, each element the value `norm_kernels.rms_norm` and then `qwen3_moe.rope` give it."""
    nh, nkv, d = q.shape[-2], k.shape[-2], q.shape[-1]
    q2, k2 = q.reshape(-1, nh * d), k.reshape(-1, nkv * d)
    if q2.stride(-1) != 1:
        q2 = q2.contiguous()
    if k2.stride(-1) != 1:
        k2 = k2.contiguous()
    rows = q2.shape[0]
    cos, sin = cos.reshape(-1, d).contiguous(), sin.reshape(-1, d).contiguous()
    if cos.shape[0] != rows:
        raise ValueError(f"rope tables for {cos.shape[0]} positions, {rows} rows of q")
    qo, ko = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    qw, kw, eps = norms if norms is not None else (q2, k2, 0.0)  # unread without NORM
    if rows:
        _norm_rope_kernel[(rows, nh + nkv)](q2, k2, cos, sin, qw, kw, qo, ko, eps, q2.stride(0), k2.stride(0),
                                            NH=nh, NKV=nkv, D=d, NORM=norms is not None, num_warps=1)
    return qo, ko
