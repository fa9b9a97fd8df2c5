"""The MoE combine in one Triton kernel (the model's `MoEBlock.combine` is a product, an inverse permutation's
gather and a sum over k: three passes over the T x k expert rows, two of them writing it).

Same function as `MoEBlock.combine`: each of a token's k rows times its router weight, rounded to the rows' dtype
(the bf16 product torch's `y_sorted * w` makes), summed over k in float32 in the order of the token's choices and
rounded once. torch's reduction may add the k terms in another order, so the two can differ in a last bit where a
float32 sum lands near a rounding midpoint.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _combine_kernel(y_ptr, rows_ptr, w_ptr, out_ptr, H, stride_y, stride_out, TOP_K: tl.constexpr,
                    BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(rows_ptr + t * TOP_K + j).to(tl.int64)
        w = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
        y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        acc += (y * w).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_combine(y_sorted: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """out [T, H]: out[t] = sum over j < top_k of y_sorted[rows[t * top_k + j]] * weights[t * top_k + j] (`rows`:
    where each of a token's choices sits among the expert-sorted rows; `weights`: the router's, token-major)."""
    n, h = rows.numel() // top_k, y_sorted.shape[-1]
    y_sorted = y_sorted.contiguous()
    out = torch.empty((n, h), dtype=y_sorted.dtype, device=y_sorted.device)
    if n:
        block = min(1024, triton.next_power_of_2(h))
        _combine_kernel[(n, triton.cdiv(h, block))](y_sorted, rows.contiguous(), weights.contiguous(), out, h,
                                                    y_sorted.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block,
                                                    num_warps=4)
    return out
