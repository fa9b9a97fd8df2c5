"""Block-scaled FP8 matmuls for the trainer, forward and backward: `apply_fp8_training(model)`.

Master weights stay in the parameters' own dtype (fp32 or bf16) and the optimiser never sees FP8:
each forward quantises the current weights (128x128 blocks) and the inputs (per token per 128
channels). The backward pass quantises the incoming gradient the same way, so
- dgrad  dx = dy W: dy per row per 128 output channels, W by the transposed 128x128 blocks
  (a 128x128 block layout is its own transpose: no re-quantisation);
- wgrad  dW = dy^T x: both operands per channel per 128 tokens (DeepSeek-V3's 1x128 along the
  contraction), computed by the same kernel with row-group scales on both sides.
Expert weight gradients are the one exception: their contraction runs over a variable number of
tokens per expert, so they are taken in the activations' dtype (bf16), through `torch._grouped_mm`
on CUDA. Router gates, norms, embeddings and the LM head are left alone.

Invariant: the gradients equal those of the high-precision layer up to FP8 rounding;
`tests/fp8/test_model_fp8.py` bounds the difference and checks that training still learns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from node.fp8.ops import grouped_linear, quantize_activation, scaled_gemm
from node.fp8.quantize import quantize_weight
from node.model.moe import GroupedExperts
from node.model.served_form import is_decoder_projection


class FP8Matmul(torch.autograd.Function):
    """y = x @ w^T, every product in block-scaled e4m3 with float32 accumulation."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        x_q, x_s = quantize_activation(x2)
        w_q, w_s = quantize_weight(w)
        y = scaled_gemm(x_q, x_s, w_q, w_s, out_dtype=x.dtype)
        ctx.save_for_backward(x2, w_q, w_s)
        ctx.w_dtype, ctx.lead = w.dtype, lead
        return y.view(*lead, w.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # noqa: ANN001, ANN205
        x2, w_q, w_s = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dy_q, dy_s = quantize_activation(dy2)
            dx = scaled_gemm(dy_q, dy_s, w_q.t().contiguous(), w_s.t().contiguous(), out_dtype=dy.dtype)
            dx = dx.view(*ctx.lead, x2.shape[1])
        if ctx.needs_input_grad[1]:
            a_q, a_s = quantize_activation(dy2.t().contiguous())
            b_q, b_s = quantize_activation(x2.t().contiguous())
            dw = scaled_gemm(a_q, a_s, b_q, b_s, b_group_n=1, out_dtype=torch.float32).to(ctx.w_dtype)
        return dx, dw


def _grouped_wgrad(x: torch.Tensor, dy: torch.Tensor, counts: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """dW[e] = dy_e^T x_e over each expert's rows, [E, N, K], in the activations' dtype."""
    if x.is_cuda and hasattr(torch, "_grouped_mm"):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x.t(), dy, offs=offs).transpose(-2, -1)
    dw = x.new_zeros(shape)
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            dw[e] = dy[start : start + c].t() @ x[start : start + c]
            start += c
    return dw


class FP8GroupedMatmul(torch.autograd.Function):
    """Rows of x sorted by expert (counts [E]) times w[e]^T; forward and dgrad in FP8."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        w_q, w_s = quantize_weight(w)
        ctx.save_for_backward(x, counts, w_q, w_s)
        ctx.w_dtype, ctx.w_shape = w.dtype, w.shape
        return grouped_linear(x.contiguous(), counts, w_q, w_s)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # noqa: ANN001, ANN205
        x, counts, w_q, w_s = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = grouped_linear(dy, counts, w_q.transpose(1, 2).contiguous(), w_s.transpose(1, 2).contiguous())
        if ctx.needs_input_grad[2]:
            dw = _grouped_wgrad(x.to(dy.dtype), dy, counts, ctx.w_shape).to(ctx.w_dtype)
        return dx, None, dw


class FP8TrainLinear(nn.Linear):
    """An `nn.Linear` (same parameter, same name) whose matmuls run in block-scaled FP8."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return F.linear(x, self.weight, self.bias)
        return FP8Matmul.apply(x, self.weight)


class FP8TrainGroupedExperts(GroupedExperts):
    """`GroupedExperts` (same parameters) with FP8 forward and dgrad."""

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gu = FP8GroupedMatmul.apply(x_sorted, counts, self.gate_up_proj)
        gate, up = gu.chunk(2, dim=-1)
        return FP8GroupedMatmul.apply(F.silu(gate) * up, counts, self.down_proj)


def apply_fp8_training(model: nn.Module) -> nn.Module:
    """Make every decoder projection and expert bank compute in FP8, in place, keeping parameters."""
    for name, mod in list(model.named_modules()):
        if type(mod) is nn.Linear and is_decoder_projection(name):
            mod.__class__ = FP8TrainLinear
        elif type(mod) is GroupedExperts:
            mod.__class__ = FP8TrainGroupedExperts
    return model
