"""Triton split-K decode attention (see `attention.py` for the contract).

On float32 inputs the dots run in IEEE float32 (`input_precision="ieee"`), not Triton's default TF32: a
float32 run is judged against exact float32 (the validator's prefill runs with TF32 off,
`node.replay.exact_float32`), whose bounds TF32's 10-bit mantissa on q, k and p was never calibrated into
(an honest float32 node on the H200 was banned in `sim --device cuda` with TF32 here, session 13). bf16
inputs are unaffected."""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, o_ptr, lse_ptr,
                   stride_qb, stride_qh, stride_ks, stride_kl, stride_kh,
                   stride_ob, stride_oh, stride_os, stride_lb, split_len, sm_scale,
                   SPLITS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                   BLOCK_N: tl.constexpr, FIXED_ITERS: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    n = tl.load(len_ptr + b).to(tl.int32)
    start = sp * split_len
    end = tl.minimum(start + split_len, n)
    g = tl.arange(0, GP)
    gmask = g < G
    heads = kvh * G + g
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dd[None, :], mask=gmask[:, None], other=0.0)
    m = tl.full((GP,), float("-inf"), tl.float32)
    l_sum = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    base = slot * stride_ks + kvh * stride_kh
    if FIXED_ITERS > 0:  # Triton's CPU interpreter cannot loop to a loaded bound; masks do the rest
        n_iter = 0
    else:
        n_iter = tl.cdiv(tl.maximum(end - start, 0), BLOCK_N)
    for it in range(0, FIXED_ITERS if FIXED_ITERS > 0 else n_iter):
        offs = start + it * BLOCK_N + tl.arange(0, BLOCK_N)
        km = offs < end
        kv_off = base + offs[:, None].to(tl.int64) * stride_kl + dd[None, :]
        k = tl.load(k_ptr + kv_off, mask=km[:, None], other=0.0)
        if IEEE:  # float32 in full: no TF32 rounding of q and k
            qk = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        else:
            qk = tl.dot(q, tl.trans(k)) * sm_scale
        qk = tl.where(km[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a slice with no key yet
        alpha = tl.exp(m - safe)
        p = tl.exp(qk - safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=km[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    has = l_sum > 0
    out = acc / tl.where(has, l_sum, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
    o_off = b * stride_ob + heads[:, None] * stride_oh + sp * stride_os + dd[None, :]
    tl.store(o_ptr + o_off, out, mask=gmask[:, None])
    tl.store(lse_ptr + b * stride_lb + heads * SPLITS + sp, lse, mask=gmask)


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slots: torch.Tensor, lens: torch.Tensor, splits: int) -> torch.Tensor:
    b, nh, d = q.shape
    _, max_len, nkv, _ = k_cache.shape
    g = nh // nkv
    gp = max(16, triton.next_power_of_2(g))
    block_n = 64
    split_len = triton.cdiv(triton.cdiv(max_len, splits), block_n) * block_n
    o = torch.empty(b, nh, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, nh, splits, dtype=torch.float32, device=q.device)
    q = q.contiguous()
    _decode_kernel[(b, nkv, splits)](
        q, k_cache, v_cache, slots, lens, o, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), split_len, 1.0 / math.sqrt(d),
        SPLITS=splits, G=g, GP=gp, D=d, BLOCK_N=block_n,
        FIXED_ITERS=split_len // block_n if os.environ.get("TRITON_INTERPRET") == "1" else 0,
        IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2,
    )
    if splits == 1:
        return o[:, :, 0].to(q.dtype)
    mx = lse.max(-1, keepdim=True).values
    w = torch.exp(lse - mx)
    return ((o * w[..., None]).sum(2) / w.sum(-1)[..., None]).to(q.dtype)
