"""The trainer's token logprobs on a GPU as one autograd function over the LM head's logits.

log_softmax(logits / T)[target] of N rows of a 49k-152k-word vocabulary: in torch ops (`node.rl.loss.token_logprobs`)
each chunk of rows is copied to float32, scaled, reduced and, checkpointed, all of it again in the backward, then the
softmax, its scaling and the chunks' copies back: some forty bytes moved a logit. Here the forward reads each logit
once (a program a row: an online log-sum-exp over its words, minus its target's scaled logit) and keeps N
log-sum-exps; the backward reads each logit once more and writes its gradient, (1[v = target] - softmax_v) * g / T,
in the logits' dtype. On the 1.87B shape at 151,936 words the torch ops' log-sum-exp and its backward were ~250 of ~550 ms of a
packed step's kernels (`benchmarks.trainer_profile`, H100, session 37).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)
_checked: dict[tuple[str, torch.dtype], str | None] = {}
"""Per (device, dtype): why the kernels may not be used (they failed or differed from the torch ops), or None."""


BLOCK = 2048
"""Words a program reads at a time."""
CHUNK = 8 * BLOCK
"""Words a program of the backward covers (a row's gradient is cut in chunks, for more programs than rows)."""


@triton.jit
def _forward_kernel(x_ptr, tgt_ptr, lse_ptr, out_ptr, V, stride_x, inv_t, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_x
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for j in range(0, V, BLOCK):
        offs = j + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, x)
        s = s * tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_new)) + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
        m = m_new
    top = tl.max(m, 0)
    lse = top + tl.log(tl.sum(s * tl.exp(tl.where(m == float("-inf"), float("-inf"), m - top)), 0))
    tgt = tl.minimum(tl.maximum(tl.load(tgt_ptr + row), 0), V - 1)  # never a read outside the row
    tl.store(lse_ptr + row, lse)
    tl.store(out_ptr + row, tl.load(base + tgt).to(tl.float32) * inv_t - lse)


@triton.jit
def _grad_kernel(x_ptr, tgt_ptr, lse_ptr, g_ptr, out_ptr, V, stride_x, stride_o, inv_t,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    tgt = tl.load(tgt_ptr + row)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(g_ptr + row).to(tl.float32) * inv_t
    for j in range(0, CHUNK, BLOCK):
        offs = c * CHUNK + j + tl.arange(0, BLOCK)
        inside = offs < V
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=inside, other=float("-inf")).to(tl.float32)
        p = tl.exp(x * inv_t - lse)
        d = (tl.where(offs == tgt, 1.0, 0.0) - p) * scale
        tl.store(out_ptr + row.to(tl.int64) * stride_o + offs, d.to(out_ptr.dtype.element_ty), mask=inside)


class TokenLogprobs(torch.autograd.Function):
    """(logits [N, V] on a GPU, targets [N], temperature > 0) -> logprobs [N] float32."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        logits = logits.contiguous()
        targets = targets.contiguous()
        n, v = logits.shape
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        if n:
            _forward_kernel[(n,)](logits, targets, lse, logp, v, logits.stride(0), 1.0 / temperature, BLOCK=BLOCK,
                                  num_warps=8)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        return logp

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, lse = ctx.saved_tensors
        n, v = logits.shape
        out = torch.empty_like(logits)
        if n:
            _grad_kernel[(n, triton.cdiv(v, CHUNK))](
                logits, targets, lse, grad.float().contiguous(), out, v, logits.stride(0), out.stride(0),
                1.0 / ctx.temperature, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)
        return out, None, None


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `TokenLogprobs` runs on `device` in `dtype`: checked once against the torch ops (2 rows of 5,000 words,
    forward and backward); where it fails or differs, logged once and the torch ops serve instead."""
    from node.rl.loss import _chunk_logprobs

    key = (str(device), dtype)
    if key not in _checked:
        try:
            gen = torch.Generator().manual_seed(0)
            x = (3 * torch.randn(2, 5000, generator=gen)).to(device, dtype)
            t = torch.tensor([7, 4321], device=device)
            outs = []
            for fn in (lambda a: TokenLogprobs.apply(a, t, 0.7), lambda a: _chunk_logprobs(a, t, 0.7)):
                a = x.clone().requires_grad_()
                with torch.enable_grad():
                    y = fn(a)
                    (y * torch.tensor([1.0, -2.0], device=device)).sum().backward()
                outs.append((y.detach().float(), a.grad.float()))
            (y1, g1), (y2, g2) = outs
            err = max(float((y1 - y2).abs().max()), float((g1 - g2).abs().max() / g2.abs().max()))
            _checked[key] = None if err < 1e-2 else f"it differs from the torch ops by {err:.3g}"
        except Exception as e:  # noqa: BLE001 -- a Triton build or launch failure of any kind: said once, never silent
            _checked[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        if _checked[key] is not None:
            log.warning("the trainer's token-logprob kernels cannot run on %s in %s (%s): the torch ops compute them",
                        device, dtype, _checked[key])
    return _checked[key] is None
