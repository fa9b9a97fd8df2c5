"""Triton passes of the seeded sampler (`device_sampling`) and of the validator's replay of it: log-sum-exp, then the
perturbed best (and second-best) word of each chunk.

Each program reads one CHUNK of one row's logits; per-chunk partials are reduced in torch. The
hash that draws the noise is splitmix64 in uint64 (Triton's shifts on unsigned types are logical
and its multiplies wrap), so the noise equals `sampling.uniforms` bit for bit before the logs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096
BLOCK = 1024


@triton.jit
def _gumbel(seed, offs):
    """Gumbel noise (float32) of word ids `offs` for a token seed (uint64): splitmix64 of seed + (id + 1) * golden."""
    h = seed + (offs + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB
    h = h ^ (h >> 31)
    u = ((h >> 11).to(tl.float64) + 0.5) * (1.0 / 9007199254740992.0)
    return (-tl.log(-tl.log(u))).to(tl.float32)


@triton.jit
def _lse_kernel(x_ptr, t_ptr, m_ptr, s_ptr, V, stride_x, NC,
                CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.load(t_ptr + row)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for j in range(0, CHUNK, BLOCK):
        offs = c * CHUNK + j + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        x = tl.where(t > 0, x / tl.where(t > 0, t, 1.0), x)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_new)) + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
        m = m_new
    mm = tl.max(m, 0)
    ss = tl.sum(s * tl.exp(tl.where(m == float("-inf"), float("-inf"), m - mm)), 0)
    tl.store(m_ptr + row * NC + c, mm)
    tl.store(s_ptr + row * NC + c, ss)


def sample_triton(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B] long, logprobs [B], log-sum-exp [B]) by the seeded rule, top_p = 1; no host sync."""
    temps = temps.float().contiguous()
    lse = _lse(logits, temps)
    b1, i1, _ = _chunk_best(logits, temps, seeds, lse)
    tokens = i1.gather(1, b1.argmax(1, keepdim=True)).squeeze(1).long()
    return tokens, _logprob_of(logits, temps, lse, tokens), lse


def _lse(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp of logits / T (T <= 0: of the logits), [B] float32: per-chunk partials, reduced here."""
    b, v = logits.shape
    nc = triton.cdiv(v, CHUNK)
    m = torch.empty(b, nc, dtype=torch.float32, device=logits.device)
    s = torch.empty(b, nc, dtype=torch.float32, device=logits.device)
    _lse_kernel[(b, nc)](logits, temps, m, s, v, logits.stride(0), nc, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)
    mx = m.max(1, keepdim=True).values
    return (mx + torch.log((s * torch.exp(m - mx)).sum(1, keepdim=True))).squeeze(1).contiguous()


def _logprob_of(logits: torch.Tensor, temps: torch.Tensor, lse: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T)[token] of each row, from its log-sum-exp."""
    x = logits.gather(1, tokens[:, None]).squeeze(1).float()
    return torch.where(temps > 0, x / torch.where(temps > 0, temps, torch.ones_like(temps)), x) - lse


@triton.jit
def _top2_kernel(x_ptr, t_ptr, seed_ptr, lse_ptr, keep_ptr, b1_ptr, i1_ptr, b2_ptr, V, stride_x, stride_keep, NC,
                 MASKED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """One chunk of one row: the best and second-best score (log-probability plus the token's Gumbel noise where
    t > 0, outside the nucleus -inf where MASKED) and the best's index; ties keep the lowest index and make the
    second equal the best (a zero margin, as a top-2 of tied values gives)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.load(t_ptr + row)
    lse = tl.load(lse_ptr + row)
    seed = tl.load(seed_ptr + row).to(tl.uint64)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    second = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_i = tl.zeros((BLOCK,), tl.int32)
    for j in range(0, CHUNK, BLOCK):
        offs = c * CHUNK + j + tl.arange(0, BLOCK)
        valid = offs < V
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=valid, other=float("-inf")).to(tl.float32)
        x = tl.where(t > 0, x / tl.where(t > 0, t, 1.0), x)
        score = (x - lse) + tl.where(t > 0, _gumbel(seed, offs), 0.0)
        if MASKED:
            keep = tl.load(keep_ptr + row.to(tl.int64) * stride_keep + offs, mask=valid, other=0)
            score = tl.where(keep != 0, score, float("-inf"))
        score = tl.where(valid, score, float("-inf"))
        take = score > best
        second = tl.where(take, best, tl.maximum(second, score))
        best_i = tl.where(take, offs, best_i)
        best = tl.where(take, score, best)
    b = tl.max(best, 0)
    i = tl.min(tl.where(best == b, best_i, 2147483647), 0)
    s = tl.max(tl.where(best_i == i, second, best), 0)
    tl.store(b1_ptr + row * NC + c, b)
    tl.store(i1_ptr + row * NC + c, i)
    tl.store(b2_ptr + row * NC + c, s)


def _chunk_best(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, lse: torch.Tensor,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row and chunk of `CHUNK` words ([B, chunks] each): the best score, its word, the second-best score."""
    n, v = logits.shape
    nc = triton.cdiv(v, CHUNK)
    dev = logits.device
    b1 = torch.empty(n, nc, dtype=torch.float32, device=dev)
    i1 = torch.empty(n, nc, dtype=torch.int32, device=dev)
    b2 = torch.empty(n, nc, dtype=torch.float32, device=dev)
    masked = keep is not None
    keep_u8 = keep.to(torch.uint8).contiguous() if masked else b1
    _top2_kernel[(n, nc)](logits, temps, seeds.contiguous(), lse, keep_u8, b1, i1, b2, v, logits.stride(0),
                          keep_u8.stride(0) if masked else 0, nc, MASKED=masked, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)
    return b1, i1, b2


def replay_triton(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, claimed: torch.Tensor,
                  keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The validator's replay of the seeded rule over rows of logits [N, V] in two passes of Triton (no [N, V]
    temporaries): (the claimed token's log_softmax(logits / T) [N], the rule's token [N] long, its margin over the
    runner-up [N]). T = `temps` where > 0, where noise is drawn from `seeds` (`sampling.uniforms`' bits); T <= 0
    is greedy: no scaling, no noise. `keep` (bool [N, V]): each row's nucleus, the rest never chosen."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    temps = temps.float().contiguous()
    lse = _lse(logits, temps)
    b1, i1, b2 = _chunk_best(logits, temps, seeds, lse, keep)
    if b1.shape[1] == 1:
        first, runner_up, token = b1[:, 0], b2[:, 0], i1[:, 0]
    else:  # the best chunk's best, against the larger of its runner-up and the next chunk's best
        top = b1.topk(2, dim=1)
        at = top.indices[:, :1]
        first, token = top.values[:, 0], i1.gather(1, at).squeeze(1)
        runner_up = torch.maximum(b2.gather(1, at).squeeze(1), top.values[:, 1])
    return _logprob_of(logits, temps, lse, claimed), token.long(), first - runner_up
