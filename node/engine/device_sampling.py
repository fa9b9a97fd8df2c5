"""The seeded sampling rule of `node.engine.sampling`, computed where the logits are (GPU or CPU).

Same rule, same noise: the uniform for vocabulary entry i of a row is splitmix64 of
(token_seed + (i + 1) * golden ratio), in 64-bit wrapping integer arithmetic, turned into Gumbel
noise in float64 and rounded to float32; the token is the argmax of log_softmax(logits / T) plus
that noise (greedy rows: no noise). On CUDA two Triton passes over the logits (log-sum-exp, then
the perturbed argmax) replace the [B, V] temporaries of the CPU rule, with no host
synchronisation, so the whole step can be captured in a CUDA graph.

Tolerance against the CPU reference (`sampling.sample`) on the same logits: the noise is
bit-identical (the integer hash is exact; the float64 logs may differ in the last float64 bit,
far below the float32 rounding); log-probabilities agree within 2e-6 absolute (float32
log-sum-exp summed in another order), and the token is the same wherever the reference's top-two
perturbed scores differ by more than 1e-5. `tests/engine/test_cuda_engine_gpu.py::test_device_sampler_matches_cpu_rule` pins both.
Top-p rows take `sample_torch` (a sort over the vocabulary), outside the captured step.
"""

from __future__ import annotations

import numpy as np
import torch

from node.engine.sampling import token_seeds, top_p_mask

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_M64 = (1 << 64) - 1


def _s64(u: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return u - (1 << 64) if u >= 1 << 63 else u


def seed_row(seed: int, first: int, count: int) -> np.ndarray:
    """token_seed(seed, p) for p in [first, first + count), as int64 (they are < 2^63)."""
    return np.array(token_seeds(seed, range(first, first + count)), dtype=np.int64)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def gumbel_torch(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 Gumbel noise for int64 token seeds [B], on the seeds' device."""
    i = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device)
    x = seeds[:, None] + i[None, :] * _s64(_GOLDEN)
    x = (x ^ _srl(x, 30)) * _s64(_MIX1)
    x = (x ^ _srl(x, 27)) * _s64(_MIX2)
    x = x ^ _srl(x, 31)
    u = (_srl(x, 11).double() + 0.5) * (1.0 / (1 << 53))
    return (-torch.log(-torch.log(u))).float()


def sample_torch(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor,
                 top_p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B], logprobs [B], log-sum-exp of logits / T [B]) by the seeded rule; plain torch
    on any device (no host sync)."""
    logits = logits.float()
    greedy = temps <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    lse = torch.logsumexp(scaled, dim=-1)
    logp = torch.log_softmax(scaled, dim=-1)
    scores = logp
    if top_p is not None:
        keep = top_p_mask(logp, top_p) | (top_p >= 1)[:, None]  # rows at top_p 1 keep every token
        scores = scores.masked_fill(~keep, float("-inf"))
    noise = gumbel_torch(seeds, logits.shape[-1]).masked_fill(greedy[:, None], 0.0)
    tokens = (scores + noise).argmax(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), lse


def sample_device(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, logprobs, log-sum-exp) [B] for top_p = 1: Triton on CUDA, `sample_torch` elsewhere."""
    if logits.is_cuda:
        from node.engine.sampling_kernels import sample_triton

        return sample_triton(logits, temps, seeds)
    return sample_torch(logits, temps, seeds)


def token_logprobs(logits: torch.Tensor, temps: torch.Tensor, lse: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T)[token] per row, given the rows' log-sum-exp from the sampler."""
    x = logits.gather(-1, tokens[:, None]).squeeze(-1).float()
    return torch.where(temps > 0, x / torch.where(temps > 0, temps, torch.ones_like(temps)), x) - lse
