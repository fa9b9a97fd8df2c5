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
