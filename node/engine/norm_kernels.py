"""RMSNorm in one Triton kernel (the model's RMSNorm is seven elementwise kernels).

Same function as `node.model.qwen3_moe.RMSNorm`: x in float32 times rsqrt(mean(x^2) + eps), rounded
to x's dtype, then times the weight in that dtype (a bf16 x bf16 product is exact in float32, so
rounding it once gives the bf16 product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_kernel(x_ptr, w_ptr, y_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    y = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + offs, (w * y).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x (any leading shape)."""
    n = x.shape[-1]
    x2 = x.contiguous().view(-1, n)
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_kernel[(x2.shape[0],)](x2, weight, y, eps, N=n, BLOCK=triton.next_power_of_2(n), num_warps=4 if n > 256 else 1)
    return y.view(x.shape)
