"""Judging a submission's rollouts together: small drift that no single rollout shows, pooled over all of them.

Per-rollout bounds (`verification.checks.THRESHOLDS`) must pass the worst honest rollout of every
hardware path, and a short rollout's statistics are noisy, so they sit at 1.5x the honest worst: a
policy 1% of the weights' std away moves a bf16 rollout's figures by about as much as honest
kernels do, and passes (issue 26: 0.8% of such rollouts caught on an H200). A submission (one work
unit: its group of rollouts, one submitter) holds tens of chunks and hundreds of tokens. Their
pooled means have a spread that falls as 1/sqrt(n), while a wrong policy shifts every one of them:
the bound here is the honest centre with a hardware margin plus a width that shrinks with the pool.

Invariant: pooling only adds rejections to claims that passed alone, and only for a precision with
calibrated `POOLED` bounds; a precision without them is judged per rollout as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from verification.reasons import Reason, Severity, graded


@dataclass
class Evidence:
    """What one claim's recomputation measured, as sums, so the claims of a submission add up."""

    chunks: int = 0
    """Proof chunks whose mantissas were read (at least one exponent matched)."""
    exp_mismatches: int = 0
    """Summed over those chunks: exponent or sign differences at the validator's top-k."""
    mant_err: float = 0.0
    """Summed over those chunks: each chunk's mean |mantissa difference| (bf16 ulps)."""
    tokens: int = 0
    """Tokens whose logprob error is summed (each version segment's largest left out: heavy tails)."""
    logprob_err: float = 0.0
    """Summed over those tokens: |claimed - recomputed| logprob (nats)."""

    def add(self, other: Evidence) -> None:
        self.chunks += other.chunks
        self.exp_mismatches += other.exp_mismatches
        self.mant_err += other.mant_err
        self.tokens += other.tokens
        self.logprob_err += other.logprob_err

    def means(self) -> dict[str, float]:
        """Per chunk (exponent mismatches, mantissa error) and per token (logprob error)."""
        return {"exp_per_chunk": self.exp_mismatches / max(1, self.chunks),
                "mant_err_mean": self.mant_err / max(1, self.chunks),
                "logprob_err_mean": self.logprob_err / max(1, self.tokens)}


@dataclass(frozen=True)
class PooledBound:
    """bound(n) = centre + width / sqrt(n) for a pooled mean over n chunks (or tokens)."""

    centre: float
    """The largest honest per-path mean measured, times `HARDWARE_MARGIN`."""
    width: float
    """`Z` times the largest honest per-chunk (per-token) standard deviation measured."""

    def at(self, n: int) -> float:
        return self.centre + self.width / math.sqrt(max(1, n))


@dataclass(frozen=True)
class PooledThresholds:
    exp_per_chunk: PooledBound
    mant_err_mean: PooledBound
    logprob_err_mean: PooledBound


HARDWARE_MARGIN = 1.25
"""Centres sit this far above the worst honest path measured, for kernels nobody measured."""
Z = 4.0
"""Widths in honest standard deviations of one chunk (token): a pooled mean of an honest path lies
more than this many of its own standard errors above its centre with probability ~3e-5 (normal)."""
MIN_CHUNKS = 4
"""A submission is pooled only with at least this many read chunks (fewer: the per-rollout bounds judge)."""
MIN_TOKENS = 64
"""The logprob mean is pooled only over at least this many tokens."""

POOLED: dict[str, PooledThresholds] = {
    # From `python -m benchmarks.pooled_calibration` (verification/calibration/pooled.json) over honest evidence
    # of 1x H200 (torch 2.11 cu130, Triton 3.6, CudaEngine with graphs, judged by the validator's GPU path;
    # qwen3-moe-small at decode batches 4, 64 and 256, the 48-layer Qwen3-30B-A3B-width shape at 64) and of
    # the committed cross-device fixture (H200 rollouts judged on the CPU, batches 1, 8, 64). Centres: the
    # 48-layer shape's means (bf16: 4.63 exp / 1.05 ulps / 0.0089 nats; fp8-all: 12.7 / 2.92 / 0.036) x 1.25;
    # widths: 4 x the largest per-chunk (token) sd (bf16 exp 1.84 and logprob 0.0102 and mantissa 0.16 from
    # the H200->CPU fixture; fp8-all from the 48-layer shape).
    "bfloat16": PooledThresholds(PooledBound(5.79, 7.37), PooledBound(1.31, 0.643), PooledBound(0.0111, 0.041)),
    # fp8-all: the widths from the full Qwen3-30B-A3B shape (128 experts; 512 RL rollouts of the inference
    # role's CudaEngine on an H100, judged there: per-chunk sd 10.4 exp / 0.633 ulps / 0.0391 nats, x 4); the
    # 16-expert shape's widths (16.6 / 1.70 / 0.117) rejected 2 of its 64 honest submissions of 8.
    "fp8-all-bfloat16": PooledThresholds(PooledBound(15.9, 41.6), PooledBound(3.65, 2.53),
                                         PooledBound(0.0445, 0.156)),
    # fp8-experts: the 48-layer shape's means (5.64 / 1.30 / 0.0107) x 1.25 and its sds (2.21 / 0.132 / 0.0083) x 4.
    "fp8-experts-bfloat16": PooledThresholds(PooledBound(7.05, 8.84), PooledBound(1.62, 0.527),
                                             PooledBound(0.01335, 0.0333)),
}
"""Per engine precision (the keys of `checks.THRESHOLDS`): a precision absent here (float32 and FP8 on a
float32 base: CPU engines agree with the validator bit for bit, no GPU evidence yet) is not pooled."""


POOLED_DETAIL = "pooled over"
"""How a pooled failure's detail begins (a benchmark tells it from a claim's own failure by it)."""


@dataclass(frozen=True)
class PooledFailure:
    reason: Reason
    detail: str
    severity: Severity


def check_pooled(ev: Evidence, precision: str, rollouts: int,
                 bounds: dict[str, PooledThresholds] | None = None) -> PooledFailure | None:
    """The pooled statistic furthest past its bound, if any (None: within every bound, or not pooled).
    `bounds`: other bounds than `POOLED` (a calibration judging evidence by its candidates)."""
    t = (POOLED if bounds is None else bounds).get(precision)
    if t is None or ev.chunks < MIN_CHUNKS:
        return None
    m = ev.means()
    over = [("hidden", Reason.HIDDEN_MISMATCH, m["exp_per_chunk"], t.exp_per_chunk.at(ev.chunks), "exponent "
             "mismatches per chunk"),
            ("hidden", Reason.HIDDEN_MISMATCH, m["mant_err_mean"], t.mant_err_mean.at(ev.chunks), "mantissa error "
             "per chunk")]
    if ev.tokens >= MIN_TOKENS:
        over.append(("logprob", Reason.LOGPROB_MISMATCH, m["logprob_err_mean"], t.logprob_err_mean.at(ev.tokens),
                     "logprob error per token"))
    worst = max(over, key=lambda o: o[2] / o[3])
    _, reason, got, bound, what = worst
    if got <= bound:
        return None
    n = ev.tokens if reason == Reason.LOGPROB_MISMATCH else ev.chunks
    return PooledFailure(reason, f"{POOLED_DETAIL} {rollouts} rollouts: {what} {got:.4f} > {bound:.4f} "
                         f"(n = {n})", graded(got / bound))
