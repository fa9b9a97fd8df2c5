"""Judging a submission's rollouts together: small drift that no single rollout shows, pooled over all of them.

Per-rollout bounds (`verification.checks.THRESHOLDS`) must pass the worst honest rollout of every
hardware path, and a short rollout's statistics are noisy, so they sit at 1.5x the honest worst: a
policy 1% of the weights' std away moves a bf16 rollout's figures by about as much as honest
kernels do, and passes (issue 26: 0.8% of such rollouts caught on an H200). A submission (one work
unit: its group of rollouts, one submitter) holds tens of chunks and hundreds of tokens. Their
pooled means have a spread that falls as 1/sqrt(n), while a wrong policy shifts every one of them:
the bound here is the honest centre with a hardware margin plus a width that shrinks with the pool.

Bounds are the precision's (`POOLED`), or a served shape's own where its honest evidence calibrated them
(`POOLED_BY_SHAPE`, for submissions no longer than that evidence's sequences: `bounds_for`).

Invariant: pooling only adds rejections to claims that passed alone, and only for a precision with
calibrated bounds; a precision without them is judged per rollout as before.
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
    positions: int = 0
    """The longest sequence (prompt + completion) among the claims (0: not told): a shape's own bounds hold only up
    to the length their calibration measured (`PooledThresholds.max_positions`)."""

    def add(self, other: Evidence) -> None:
        self.chunks += other.chunks
        self.exp_mismatches += other.exp_mismatches
        self.mant_err += other.mant_err
        self.tokens += other.tokens
        self.logprob_err += other.logprob_err
        self.positions = max(self.positions, other.positions)

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
    max_positions: int | None = None
    """The longest sequence (prompt + completion) the calibration measured, where the bounds are a shape's own:
    honest drift grows along a sequence, so a longer submission is judged by the precision's bounds (`bounds_for`).
    None: any length."""

    def hold_for(self, positions: int) -> bool:
        """Whether a submission whose longest sequence has `positions` positions (0: not told) is within the
        lengths these bounds were measured at."""
        return self.max_positions is None or positions <= self.max_positions


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


def shape_of(config) -> str:
    """The served architecture as `POOLED_BY_SHAPE` names it: what sets the size of honest drift (depth, widths,
    experts), not the vocabulary or the sequence limit. `config`: a `node.model.ModelConfig`."""
    return (f"{config.model_type}:layers={config.num_hidden_layers}:hidden={config.hidden_size}"
            f":experts={config.num_experts}x{config.moe_intermediate_size}:top={config.num_experts_per_tok}")


SHORT = 64
"""The longest sequence of the test harness's rollouts (`detection_device`, `false_bans` by default): a shape whose
evidence is only theirs is calibrated up to here. An honest 8-submission of the 5.2B network's ~1,000-token rollouts
crossed the 8-layer shape's exponent bound calibrated on them alone (session 35: 2.469 per chunk against 2.451 over
256 chunks): honest drift spreads wider along a long sequence, so longer submissions keep `POOLED` until evidence of
their length calibrates them."""
LONG_8L = 1008
"""The longest sequence of the 8-layer shape's evidence: session 36's 1,000-token rollouts (`detection_device
--max-seq 1100 --new-tokens 1000`, bf16 / FP8 all / FP8 experts, 1x H100) beside the harness's short ones."""
NETWORK_8L_BF16 = 1230
"""bf16's at the 8-layer shape: the 5.2B network's own rollouts on an H200 (session 38, `benchmarks.gpu_network`,
k = 2 and 1; the traced validator's evidence, `network_evidence-5b-long-k*-h200-s38.jsonl.gz`), 625 honest
submissions of 8 up to 1,230 positions, judged at these bounds: 0 rejected, the nearest 0.77 of a bound. They set
no centre or width (each lies inside those set by the harness's evidence): only the length they hold to."""

NETWORK_SMALL_FP8_ALL = 339
"""FP8 all's at the 0.52B network's shape: that network's own rollouts on an H100 (session 41, `benchmarks.gpu_network
--fp8 all`, versions in their served form, k = 2; the traced validator's evidence,
`network_evidence-small-fp8-served-k2-h100-s41.jsonl.gz`), 265 honest submissions of 8 up to 339 positions, judged by
the shape's bounds: 0 rejected, the nearest 0.55 of a bound. They set no centre or width: calibrated with them, their
longer claims' wider per-chunk spread (mantissa 0.46 ulps against 0.24-0.31 in the harness's 64-position ones) would
widen the shape's widths by half and halve what they catch of one layer 1% off (0.94 -> 0.47 of its submissions), for
submissions that pass the narrower bounds already; they say only how long a sequence those bounds hold to."""

POOLED_BY_SHAPE: dict[str, dict[str, PooledThresholds]] = {
    # Honest drift grows with depth: `POOLED`'s centres come from the 48-layer shape, so at 8 layers a submission
    # tampered with by 1% of one layer's weights' std sat below them (issue 26: 1 of 32 caught in bf16, 0 in FP8;
    # its pooled mantissa error 1.02-1.20 ulps per chunk against honest 0.34-0.45 and a bound of 1.47). A served
    # shape with its own honest evidence is judged by bounds from that evidence alone, by the same rule
    # (`python -m benchmarks.pooled_calibration ... --out verification/calibration/pooled.json`, `by_shape`).
    # Only the shapes the network runs serve, which exist only as random weights (N(0, 0.02)): a real checkpoint of
    # an architecture here would be judged by random weights' drift, so real architectures are left to `POOLED`.
    #
    # The 5.2B network's model (`random:qwen3-30b-a3b-8l`: Qwen3-30B-A3B's layer, 8 layers, 128 experts): honest
    # rollouts of `CudaEngine` judged on the same GPU (torch 2.11 cu130), 1,024-1,280 per precision: short ones on
    # an H100 (sessions 28 and 33) and an H200 (session 35), 256 of 1,000 tokens on an H100 (session 36;
    # `detection_evidence-8l-*.jsonl.gz`). The long rollouts' per-chunk spread set every width (about 2x the short
    # ones' alone).
    "qwen3_moe:layers=8:hidden=2048:experts=128x768:top=8": {
        "bfloat16": PooledThresholds(PooledBound(2.32, 9.19), PooledBound(0.461, 0.371), PooledBound(0.00531, 0.0182),
                                     NETWORK_8L_BF16),
        "fp8-all-bfloat16": PooledThresholds(PooledBound(8.68, 18.6), PooledBound(1.94, 2.21),
                                             PooledBound(0.0248, 0.154), LONG_8L),
        "fp8-experts-bfloat16": PooledThresholds(PooledBound(3.90, 9.66), PooledBound(0.775, 0.512),
                                                 PooledBound(0.00805, 0.0248), LONG_8L),
    },
    # The 0.52B network's model (`random:qwen3-moe-small`: 8 layers, hidden 1024, 32 experts): 1x H200 (torch 2.11
    # cu130), decode batches 4, 64 and 256 (`pooled_evidence-h200.jsonl.gz`, the evidence `POOLED` also came from);
    # FP8 all's held to the network's lengths by its own evidence (`NETWORK_SMALL_FP8_ALL`).
    "qwen3_moe:layers=8:hidden=1024:experts=32x512:top=4": {
        "bfloat16": PooledThresholds(PooledBound(2.30, 4.49), PooledBound(0.597, 0.295), PooledBound(0.00446, 0.0124),
                                     SHORT),
        "fp8-all-bfloat16": PooledThresholds(PooledBound(8.95, 9.91), PooledBound(2.60, 1.23),
                                             PooledBound(0.0239, 0.0648), NETWORK_SMALL_FP8_ALL),
        "fp8-experts-bfloat16": PooledThresholds(PooledBound(3.59, 5.63), PooledBound(0.968, 0.380),
                                                 PooledBound(0.00685, 0.0178), SHORT),
    },
}
"""Per served shape (`shape_of`), per precision: bounds calibrated on that shape, which replace `POOLED`'s for it
(the record's figures rounded up: `verification/calibration/pooled.json` `by_shape`)."""


def bounds_for(precision: str, shape: str | None = None, positions: int = 0) -> PooledThresholds | None:
    """The pooled bounds a submission of `precision` on `shape` whose longest sequence has `positions` positions
    is judged by: the shape's own where calibrated up to that length, else the precision's (`POOLED`); None: not
    pooled."""
    own = POOLED_BY_SHAPE.get(shape or "", {}).get(precision)
    if own is not None and own.hold_for(positions):
        return own
    return POOLED.get(precision)


POOLED_DETAIL = "pooled over"
"""How a pooled failure's detail begins (a benchmark tells it from a claim's own failure by it)."""


@dataclass(frozen=True)
class PooledFailure:
    reason: Reason
    detail: str
    severity: Severity


def check_pooled(ev: Evidence, precision: str, rollouts: int, bounds: dict[str, PooledThresholds] | None = None,
                 shape: str | None = None) -> PooledFailure | None:
    """The pooled statistic furthest past its bound, if any (None: within every bound, or not pooled).
    `shape`: the served architecture (`shape_of`), for `bounds_for`; `bounds`: other bounds than those, per
    precision (a calibration judging evidence by its candidates)."""
    t = bounds_for(precision, shape, ev.positions) if bounds is None else bounds.get(precision)
    worst = nearest_bound(ev, t) if t is not None else None
    if worst is None or worst[1] <= worst[2]:
        return None
    reason, got, bound, what = worst
    n = ev.tokens if reason == Reason.LOGPROB_MISMATCH else ev.chunks
    return PooledFailure(reason, f"{POOLED_DETAIL} {rollouts} rollouts: {what} {got:.4f} > {bound:.4f} "
                         f"(n = {n})", graded(ratio(got, bound)))


def ratio(got: float, bound: float) -> float:
    """`got` over `bound`; a bound of 0 (exact agreement calibrated) makes any difference infinitely far."""
    return got / bound if bound > 0 else (math.inf if got > 0 else 0.0)


def nearest_bound(ev: Evidence, t: PooledThresholds) -> tuple[Reason, float, float, str] | None:
    """(reason, pooled figure, its bound, what it is) of the figure nearest its bound relative to it; None: a pool
    too small to judge."""
    if ev.chunks < MIN_CHUNKS:
        return None
    m = ev.means()
    figures = [(Reason.HIDDEN_MISMATCH, m["exp_per_chunk"], t.exp_per_chunk.at(ev.chunks),
                "exponent mismatches per chunk"),
               (Reason.HIDDEN_MISMATCH, m["mant_err_mean"], t.mant_err_mean.at(ev.chunks), "mantissa error per chunk")]
    if ev.tokens >= MIN_TOKENS:
        figures.append((Reason.LOGPROB_MISMATCH, m["logprob_err_mean"], t.logprob_err_mean.at(ev.tokens),
                        "logprob error per token"))
    return max(figures, key=lambda f: ratio(f[1], f[2]))
