"""Seeded sampling that a validator can re-derive.

Every decision is Gumbel-max over the temperature-scaled, top-p-filtered log-probabilities, with
the uniform for vocabulary entry i a counter-based hash (splitmix64, unsigned 64-bit integer
arithmetic) of `token_seed(seed, position)` and i: given the same logits, anyone re-derives the
same token on any platform, and a whole batch draws its noise in one vectorised pass. Where the top two perturbed scores are closer than numerical
noise (the reported `margin`), a validator cannot hold a node to the choice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    max_new_tokens: int = 32
    """Length limit of the completion."""
    seed: int = 0
    """Per-request sampling seed (derived from the work id by the coordinator)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the completion besides EOS (kept in the completion)."""
    stop_strings: tuple[str, ...] = field(default=())
    """Strings that end the completion when the decoded text ends with one."""

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1:
            raise ValueError(f"invalid sampling params {self}")


def token_seed(seed: int, position: int) -> int:
    """The generator seed for the token at absolute `position` of a request seeded `seed`."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def token_seeds(seed: int, positions: Iterable[int]) -> list[int]:
    """`token_seed(seed, p)` for each integer p, the same values: the hash of the shared "seed:" prefix is
    taken once and copied per position (a validator derives one per token it checks, thousands a round:
    0.41 against 0.63 us a token, measured on the 2-core CPU machine)."""
    prefix = hashlib.blake2b(b"%d:" % seed, digest_size=8)
    out = []
    for p in positions:
        h = prefix.copy()
        h.update(b"%d" % p)
        out.append(int.from_bytes(h.digest(), "little") & ((1 << 63) - 1))
    return out


def uniforms(seeds: list[int], vocab: int) -> np.ndarray:
    """[len(seeds), vocab] uniforms in (0, 1): splitmix64 of (seed + (i + 1) * golden ratio)."""
    base = np.array(seeds, dtype=np.uint64)[:, None]
    with np.errstate(over="ignore"):
        x = base + (np.arange(1, vocab + 1, dtype=np.uint64)[None, :] * _GOLDEN)
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
        x = x ^ (x >> np.uint64(31))
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def gumbel_noise(seeds: list[int], vocab: int) -> torch.Tensor:
    """Gumbel noise [len(seeds), vocab] for the given token seeds."""
    return torch.from_numpy(-np.log(-np.log(uniforms(seeds, vocab)))).float()


def top_p_mask(logp: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Boolean [B, V]: tokens inside each row's nucleus (the smallest set reaching mass top_p).
    The nucleus is searched among each row's top 1024 first (a full sort of a 49k-151k vocabulary
    per decode step costs more than the forward pass); rows whose top 1024 hold less than top_p of
    the mass fall back to the full sort."""
    k = min(logp.shape[-1], 1024)
    vals, order = logp.topk(k, dim=-1)
    keep_sorted = _nucleus(vals, top_p)
    # the nucleus ends inside the top k unless their mass (the mass before entry k + 1) is below top_p
    short = (vals.exp().cumsum(-1)[:, -1] < top_p) & (k < logp.shape[-1])
    mask = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, order, keep_sorted)
    if bool(short.any()):
        rows = short.nonzero().squeeze(-1)
        full_vals, full_order = logp[rows].sort(dim=-1, descending=True)
        mask[rows] = torch.zeros_like(full_vals, dtype=torch.bool).scatter(-1, full_order, _nucleus(full_vals, top_p[rows]))
    return mask


def _nucleus(sorted_logp: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    probs = sorted_logp.exp()
    keep_sorted = (probs.cumsum(-1) - probs) < top_p[:, None]
    keep_sorted[:, 0] = True
    return keep_sorted


@dataclass
class Samples:
    tokens: torch.Tensor  # [B] long
    logprobs: torch.Tensor  # [B] log_softmax(logits / T)[token]
    margins: torch.Tensor  # [B] top-1 minus top-2 perturbed score


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> Samples:
    """One token per row of `logits` [B, V]; row b uses params[b] at absolute position positions[b]."""
    logits = logits.float()
    b, v = logits.shape
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    greedy = temps == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    scores = logp.clone()
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    if bool((top_p < 1).any()):
        scores = scores.masked_fill(~top_p_mask(logp, top_p), float("-inf"))
    noise = torch.zeros(b, v)
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    if sampled:  # greedy rows draw no noise (at a 150k vocabulary the draw dominates a decode step)
        noise[sampled] = gumbel_noise([token_seed(params[i].seed, positions[i]) for i in sampled], v)
    top2 = (scores + noise).topk(2, dim=-1)
    tokens = top2.indices[:, 0]
    return Samples(tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), top2.values[:, 0] - top2.values[:, 1])
