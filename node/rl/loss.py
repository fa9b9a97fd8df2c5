"""Token-level policy loss with the trainer/inference probability ratio, masked outside a trust region.

For each model token t with advantage A and ratio r = p_trainer(t) / p_inference(t):
  loss_t = -A * r  where kept, 0 where masked.
Masking, not clipping: a token whose ratio has left the trust region in the direction its
advantage pushes (A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps_low) gets no gradient, so
several updates on one batch cannot run away; a token whose ratio is outside the hard bounds in
either direction (trainer and inference disagree too much: a stale or mismatched token) is dropped
entirely. The gradient of -A * r is -A * r * grad log p: the importance-weighted policy gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class LossConfig:
    eps_low: float = 0.2
    """Trust region below 1 for negative-advantage tokens."""
    eps_high: float = 0.2
    """Trust region above 1 for positive-advantage tokens."""
    hard_low: float = 0.125
    """Tokens with ratio below this are masked whatever their advantage."""
    hard_high: float = 8.0
    """Tokens with ratio above this are masked whatever their advantage."""


@dataclass
class LossOutput:
    loss: torch.Tensor
    masked_share: torch.Tensor
    """0-dim, detached, where the loss is: read it (`float`) once the step's work is queued, since reading a GPU
    value waits for every kernel before it."""
    mismatch_kl: torch.Tensor
    """k3 estimate of KL(inference || trainer) over loss tokens (0-dim, detached, like `masked_share`)."""


def policy_loss(trainer_logprobs: torch.Tensor, inference_logprobs: torch.Tensor, advantages: torch.Tensor,
                loss_mask: torch.Tensor, cfg: LossConfig = LossConfig()) -> LossOutput:
    """All inputs [B, T] (advantages broadcast per token); mean over tokens with loss_mask."""
    log_ratio = trainer_logprobs - inference_logprobs
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        r = ratio.detach()
        out_of_region = ((advantages > 0) & (r > 1 + cfg.eps_high)) | ((advantages < 0) & (r < 1 - cfg.eps_low))
        out_of_bounds = (r < cfg.hard_low) | (r > cfg.hard_high)
        keep = loss_mask & ~out_of_region & ~out_of_bounds
        n = loss_mask.sum().clamp(min=1)
        masked_share = (loss_mask & ~keep).sum() / n
        lr = log_ratio.detach()
        mismatch_kl = ((torch.exp(lr) - 1 - lr) * loss_mask).sum() / n
    loss = -(advantages * ratio * keep).sum() / n
    return LossOutput(loss, masked_share, mismatch_kl)


LOGPROB_CHUNK_BYTES = 1 << 30
"""float32 [rows, T, V] scores one chunk of `token_logprobs` may hold: with a 49k-152k vocabulary, a whole
batch's would be tens of GB (256 rollouts of 1,400 tokens at 49,152: 70 GB, an H200 run's trainer OOM)."""


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) gathered at targets: [B, T, V], [B, T] -> [B, T], as logit[target] / T minus
    the row's log-sum-exp, a few rows at a time: no float32 [B, T, V] tensor exists at once, and under
    autograd each chunk is recomputed in the backward (checkpointed) instead of kept. Under autograd on a GPU,
    `node.rl.logprob_kernels.TokenLogprobs` instead (the same function, a read of the logits each way)."""
    b, t, v = logits.shape
    if logits.is_cuda and logits.requires_grad and torch.is_grad_enabled() and temperature > 0:
        # a trainer's forward on a GPU: one Triton pass each way, no float32 copy (node/rl/logprob_kernels.py)
        from node.rl import logprob_kernels

        if logprob_kernels.usable(logits.device, logits.dtype):
            return logprob_kernels.TokenLogprobs.apply(logits.reshape(b * t, v), targets.reshape(b * t),
                                                       temperature).view(b, t)
    rows = max(1, LOGPROB_CHUNK_BYTES // max(1, 4 * t * v))
    if rows >= b:
        return _chunk_logprobs(logits, targets, temperature)
    grad = torch.is_grad_enabled() and logits.requires_grad
    out = []
    for a in range(0, b, rows):
        x, y = logits[a : a + rows], targets[a : a + rows]
        out.append(checkpoint(_chunk_logprobs, x, y, temperature, use_reentrant=False) if grad
                   else _chunk_logprobs(x, y, temperature))
    return torch.cat(out)


def _chunk_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    scaled = logits.float() / temperature
    return scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
