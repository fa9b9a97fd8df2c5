"""The checks TOPLOC lacks, plus the proof check, each a pure function of a claim and recomputation.

Every check returns None (pass) or a `Failure` naming the reason code and where it failed. Numeric
tolerances live here, named, with where they came from (verification/calibration/).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verification import token_figures
from verification.claim import RolloutClaim
from verification.reasons import PROOF_FACTOR, Reason, Severity, graded  # noqa: F401 (their home; importers use either)
from verification.hidden_check import ChunkStats, compare_blocks
from verification.pooled import Evidence
from verification.proof import Commitment, ChunkSpan
from verification.reference import Reference, Replay, token_logprobs  # noqa: F401 (token_logprobs: importers)

@dataclass(frozen=True)
class Thresholds:
    """Tolerances of the recomputation checks for one engine precision (the run spec fixes it and
    the validator recomputes in it). Each bounds an honest maximum measured by
    benchmarks/verification_calibration.py (verification/calibration/thresholds.json: `honest_max`), with headroom."""

    max_exp_mismatches: int
    """Per chunk, of 128: exponent or sign differs at the validator's top-k."""
    max_mant_err_mean: float
    """Per chunk: mean |mantissa difference| in bf16 ulps where exponents match."""
    max_mant_err_median: float
    """Per chunk: median of the same."""
    max_logprob_err: float
    """Per token: |claimed - recomputed| logprob (nats)."""
    max_logprob_err_mean: float
    """Per version segment of a rollout: mean of the same (catches small, systematic drift)."""
    margin_noise: float
    """A seeded choice binds only where the validator's top-two margin exceeds this."""


THRESHOLDS = {
    # CPU float32 engines agreed bit for bit with the validator's prefill (honest maxima all 0);
    # these leave room for other kernels (GPU) that the CPU calibration could not measure.
    "float32": Thresholds(max_exp_mismatches=8, max_mant_err_mean=1.0, max_mant_err_median=1.0,
                          max_logprob_err=0.01, max_logprob_err_mean=0.002, margin_noise=0.01),
    # bf16, two honest paths (verification/calibration/thresholds.json: `honest_max`, `cross_device`, `bound_set_by`):
    # CPU decode vs CPU prefill (calibration): exp 6, mantissa mean 2.73 / median 1, logprob 0.17 / mean 0.0070,
    # flip margin 0.014; H200 CudaEngine (graphs on, torch 2.11 cu130) vs the CPU validator (the committed
    # tests/fixtures/cross_device, 336 rollouts): exp 13, mantissa mean 1.88 / median 1, logprob 0.11 / checked
    # (trimmed) mean 0.0134, flip margin 0.053, which rejected 21 of 336 at the CPU-only bounds (12, 0.01,
    # 0.05). Exponent mismatches, the mean and the margin are set by the GPU->CPU path at ~1.5x its maxima
    # (20 = 1.54x, 0.02 = 1.49x, 0.08 = 1.50x); the others by the CPU calibration, as before.
    # Then the H200 GPU path at a 48-layer shape (benchmarks/results/calibration_device-h200.json: CudaEngine,
    # graphs on, judged by the validator's GPU path, Qwen3-30B-A3B widths with 16 experts, 360 rollouts,
    # batches 1-256): exp 16, checked mean 0.0151, flip margin 0.062, each x1.5 -> 24, 0.023, 0.094.
    "bfloat16": Thresholds(max_exp_mismatches=24, max_mant_err_mean=3.5, max_mant_err_median=2.0,
                           max_logprob_err=0.25, max_logprob_err_mean=0.023, margin_noise=0.094),
    # FP8 runs (RunSpec.model.fp8, docs/fp8.md): "fp8-<experts|all>-<base dtype>", engine and validator both
    # quantised by node.engine.fp8.model.apply_fp8_mode. Honest maxima from `python -m
    # benchmarks.verification_calibration --fp8 --rollouts 50` (300 rollouts per precision: engine batch
    # 1/8/32 x 1/2 threads, KV-cached decode vs prefill), on the CPU path (reference_gemm) ONLY: GPU FP8
    # kernels (Triton, DeepGEMM) against this CPU reference were NOT measured (no GPU this session). Headroom
    # as for bf16 (counts and medians x2, mantissa mean x1.3, logprob max and mean x1.5, flip margin >= 3.5x),
    # and never tighter than the plain precision's own thresholds (which keep room for other kernels).
    # An activation that lands near an e4m3 rounding boundary rounds either way under a 1e-7 difference
    # (another matmul blocking at another batch size), so FP8 on a float32 base is not bit-exact as plain
    # float32 is: fp8-all-float32 reached logprob 0.23 at engine batch 8.
    # float32 base, experts: exp 2, mantissa mean 0.43 / median 0, logprob 0.015 / mean 0.00053, no flips.
    "fp8-experts-float32": Thresholds(max_exp_mismatches=8, max_mant_err_mean=1.0, max_mant_err_median=1.0,
                                      max_logprob_err=0.025, max_logprob_err_mean=0.002, margin_noise=0.01),
    # float32 base, all: exp 7, mantissa mean 1.66 / median 1, logprob 0.23 / mean 0.0121, no flips.
    "fp8-all-float32": Thresholds(max_exp_mismatches=14, max_mant_err_mean=2.2, max_mant_err_median=2.0,
                                  max_logprob_err=0.35, max_logprob_err_mean=0.018, margin_noise=0.01),
    # bf16 base, experts: exp 9, mantissa mean 3.70 / median 2, logprob 0.63 / mean 0.026, flip margin 0.045;
    # the honest runs of `weak_tamper --fp8 experts --dtypes bfloat16` (288 other rollouts, same figures
    # without route replay) went further: exp 11, mantissa mean 4.75 / median 4, logprob mean 0.043, flip
    # margin 0.25. Bounds cover both sets (margin x2, not x3.5: it would bind almost no choice).
    "fp8-experts-bfloat16": Thresholds(max_exp_mismatches=22, max_mant_err_mean=6.2, max_mant_err_median=8.0,
                                       max_logprob_err=1.0, max_logprob_err_mean=0.064, margin_noise=0.5),
    # bf16 base, all: exp 15, mantissa mean 3.25 / median 2, logprob 0.31 / mean 0.028, flip margin 0.085 (CPU).
    # The H200 GPU path at the 48-layer shape (as for bfloat16; Triton FP8 GEMMs) went much further and the
    # CPU-set bounds rejected 33 of 360 honest rollouts: exp 30, mantissa mean 4.48 / median 4, checked mean
    # 0.066, flip margin 0.298; each x1.5 -> 45, 6.8, 6, 0.099, 0.45 (logprob max 0.286 stays inside 0.46).
    # The full Qwen3-30B-A3B shape (48 layers, 128 experts, vocabulary 151,936; H100, the inference role's
    # CudaEngine judged by the validator's GPU path; benchmarks/results/real_scale-s21-h100.json, 512 RL
    # rollouts) went further on exponents only: 53 in one chunk (one claim over 45) -> x1.5 = 80; its other
    # figures (mantissa 4.28 / 4, logprob 0.187 / 0.042, flip margin 0.169) stay inside the bounds above.
    "fp8-all-bfloat16": Thresholds(max_exp_mismatches=80, max_mant_err_mean=6.8, max_mant_err_median=6.0,
                                   max_logprob_err=0.46, max_logprob_err_mean=0.099, margin_noise=0.45),
}
REWARD_TOL = 1e-6
"""Rewards are exact functions of the transcript; only float formatting may differ."""
SEEDED_ENGINES = ("builtin",)
"""Engines that sample with the run's seeded rule, so a validator can re-derive each choice. Other
engines (vLLM: its own generator) are checked on proofs, logprobs, termination, reward and versions,
and on greedy choices, but their choices at temperature > 0 are not re-derived; a run accepts them
only if its spec names them (`RunSpec.engines`)."""


LOGPROB_OUTLIERS = 1
"""Tokens per version segment whose logprob may differ by more than `max_logprob_err` (and less than
`PROOF_FACTOR` times it) without failing; the segment's mean check leaves them out too. Honest bf16
errors are heavy-tailed: `python -m benchmarks.false_bans` saw single tokens at 0.27-0.35 nats
(logprob -3.4 to -4.7, engine batch 32, 1 thread) in 6 of 779 honest rollouts against the 0.25
bound (calibration's maximum was 0.17), each a strike, and an honest identity banned within two
minutes. Fabricated logprobs move every token (or a token far off) and still fail."""
MIN_MEAN_TOKENS = 32
"""The per-segment mean logprob check applies to segments of at least this many tokens (one proof
chunk): honest per-token errors are heavy-tailed (bf16: one token up to 0.17 nats while rollout means
stay under 0.007), so one such token in a segment of fewer than 0.17 / 0.01 = 17 tokens failed the
mean bound then in force (0.01) although every token passed; a short segment (the tail of a
mixed-version rollout) is judged per token."""


@dataclass(frozen=True)
class Failure:
    reason: Reason
    detail: str
    chunk: int | None = None
    """Index of the failing proof chunk (rollout-wide, in token order)."""
    token: int | None = None
    """Index of the failing completion token."""
    severity: Severity = Severity.PROOF
    """Deterministic checks are proof; numeric ones grade themselves (`graded`)."""


def turns(claim: RolloutClaim) -> list[tuple[int, int]]:
    """[start, end) of each model turn: maximal runs of sampled tokens."""
    out, mask, i = [], claim.sampled_mask, 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            out.append((i, j))
            i = j
        else:
            i += 1
    return out


def check_termination(claim: RolloutClaim, ref: Reference) -> Failure | None:
    """Every turn ends exactly where the engine's rule (EOS, stop token or string, length) ends it:
    not earlier (early stop) and not later (generation past a stop)."""
    sp, all_turns = claim.sampling, turns(claim)
    if not all_turns:
        return Failure(Reason.TERMINATION, "no sampled tokens")
    for t, (start, end) in enumerate(all_turns):
        last = t == len(all_turns) - 1
        for i in range(start, end):
            tok, n_turn = claim.token_ids[i], i - start + 1
            reason = None
            if tok == ref.eos_id:
                reason = "eos"
            elif tok in sp.stop_token_ids or (sp.stop_strings and any(
                    ref.decode(claim.token_ids[start : i + 1]).endswith(s) for s in sp.stop_strings)):
                reason = "stop"
            elif n_turn >= sp.max_new_tokens or len(claim.prompt_ids) + i + 1 >= ref.max_seq_len:
                reason = "length"
            if reason is None:
                continue
            if i != end - 1:
                return Failure(Reason.TERMINATION, f"turn {t} should have ended ({reason}) at token {i}", token=i)
            want = claim.finish_reason if last else "stop"
            if reason != want:
                return Failure(Reason.TERMINATION, f"turn {t} ended by {reason}, claimed {want}", token=i)
            break
        else:
            return Failure(Reason.TERMINATION, f"turn {t} stopped at token {end - 1} with no EOS, stop or limit",
                           token=end - 1)
    return None


def check_task(claim: RolloutClaim, ref: Reference) -> Failure | None:
    """The prompt is the task's, and the claimed reward is the environment's."""
    try:
        prompt = ref.prompt_ids(claim.env, claim.task_seed)
    except (KeyError, ValueError) as exc:
        return Failure(Reason.PROMPT_MISMATCH, f"unknown environment {claim.env!r}: {exc}")
    if prompt != claim.prompt_ids:
        return Failure(Reason.PROMPT_MISMATCH, "prompt differs from the task drawn from the seed")
    reward = ref.reward(claim.env, claim.task_seed, claim.token_ids)
    if abs(reward - claim.reward) > REWARD_TOL:
        return Failure(Reason.REWARD_MISMATCH, f"claimed reward {claim.reward}, recomputed {reward}")
    return None


def check_hidden(stats: list[ChunkStats], chunk_offset: int, t: Thresholds) -> Failure | None:
    """The failing chunk furthest past its thresholds (None: every chunk within them)."""
    worst, worst_excess = None, 0.0
    for i, s in enumerate(stats):
        if (s.exp_mismatches > t.max_exp_mismatches or s.mant_err_mean > t.max_mant_err_mean
                or s.mant_err_median > t.max_mant_err_median):
            excess = max(s.exp_mismatches / t.max_exp_mismatches, s.mant_err_mean / t.max_mant_err_mean,
                         s.mant_err_median / t.max_mant_err_median)
            if worst is None or excess > worst_excess:
                worst, worst_excess = Failure(Reason.HIDDEN_MISMATCH, f"exp mismatches {s.exp_mismatches}, mantissa "
                                              f"error mean {s.mant_err_mean:.2f} median {s.mant_err_median:.2f}",
                                              chunk=chunk_offset + i, severity=graded(excess)), excess
    return worst


def _trimmed_mean(err: torch.Tensor) -> float:
    """Mean of the per-token errors without the `LOGPROB_OUTLIERS` largest (systematic drift moves
    them all; one heavy-tailed honest token would otherwise decide a short segment's mean)."""
    return _trimmed_mean_of_sorted(err.sort().values)


def _trimmed_mean_of_sorted(ascending: torch.Tensor) -> float:
    return float(ascending[: max(1, len(ascending) - LOGPROB_OUTLIERS)].mean())


def _evidence(stats: list[ChunkStats], err: torch.Tensor, ascending: torch.Tensor | None = None) -> Evidence:
    """One segment's sums for pooling: chunks whose mantissas were read, and its tokens' logprob errors
    without the `LOGPROB_OUTLIERS` largest (as `_trimmed_mean`; a non-finite error pools as large).
    `ascending`: `err` sorted, where no error exceeds that clamp (the same values, sorted once for both)."""
    read = [s for s in stats if s.mant_err_mean < 2**63]
    if len(err) > 1:
        ascending = ascending if ascending is not None else err.clamp(max=1e3).sort().values
        kept = ascending[: max(0, len(err) - LOGPROB_OUTLIERS)]
    else:
        kept = err[:0]
    return Evidence(chunks=len(read), exp_mismatches=sum(s.exp_mismatches for s in read),
                    mant_err=sum(s.mant_err_mean for s in read), tokens=len(kept), logprob_err=float(kept.sum()))


def _strongest(failures: list[Failure | None]) -> Failure | None:
    """The first proof-grade failure, else the first borderline one: a borderline hidden-state
    difference does not hide a logprob or sampling failure that is proof."""
    found = [f for f in failures if f is not None]
    return next((f for f in found if f.severity == Severity.PROOF), found[0] if found else None)


@dataclass
class Segment:
    """The sampled tokens `token_idx` of one claim under one version, with the validator's recomputation of
    them: `logits` [len(token_idx), V] and `hidden` [len(token_idx), H], rows in token order. `spans` index
    into those rows; `chunk_offsets` give each span's rollout-wide chunk number; what is measured is added
    to `evidence` (the submission's pooled check, `verification.pooled`)."""

    claim: RolloutClaim
    token_idx: list[int]
    logits: torch.Tensor
    hidden: torch.Tensor
    spans: list[ChunkSpan]
    commitments: list[Commitment]
    chunk_offsets: list[int]
    evidence: Evidence | None = field(default=None)


def check_segment(claim: RolloutClaim, ref: Reference, token_idx: list[int], logits: torch.Tensor,
                  hidden: torch.Tensor, spans: list[ChunkSpan], commitments: list[Commitment],
                  chunk_offsets: list[int], evidence: Evidence | None = None) -> Failure | None:
    """`check_segments` of one segment."""
    return check_segments([Segment(claim, token_idx, logits, hidden, spans, commitments, chunk_offsets, evidence)],
                          ref)[0]


def check_segments(segments: list[Segment], ref: Reference) -> list[Failure | None]:
    """The recomputation checks of many segments (proof chunks, logprobs, seeded sampling), measured
    together and judged one by one: every chunk of every segment through one `compare_blocks`, every token
    row through one `Reference.measure_tokens` (on a GPU validator: batched passes over the rows where the
    logits are, one transfer of per-token figures back), then per segment every check on those figures,
    its strongest failure returned (`_strongest`). A segment's verdict does not depend on the others
    measured with it."""
    from verification.proof import chunk_blocks

    t = THRESHOLDS[ref.precision]
    blocks = [b for s in segments for b in chunk_blocks(s.hidden, s.spans)]
    all_stats = compare_blocks(blocks, [c for s in segments for c in s.commitments])
    claimed = [token_figures.picked(s.claim.token_ids, s.token_idx) for s in segments]
    measured = ref.measure_tokens([s.logits for s in segments], [s.claim.sampling for s in segments],
                                  [token_figures.positions(len(s.claim.prompt_ids), s.token_idx) for s in segments],
                                  claimed)
    figures = token_figures.of_segments(claimed, [token_figures.picked(s.claim.logprobs, s.token_idx)
                                                  for s in segments],
                                        [ours for ours, _ in measured], [r.tokens for _, r in measured],
                                        [r.margins for _, r in measured], t.max_logprob_err, t.margin_noise)
    out, k = [], 0
    for s, (_, replay), fig in zip(segments, measured, figures):
        stats = all_stats[k : k + len(s.spans)]
        k += len(s.spans)
        out.append(_judge_segment(s, t, stats, fig, replay))
    return out


def _judge_segment(s: Segment, t: Thresholds, stats: list[ChunkStats], fig: token_figures.TokenFigures,
                   replay: Replay) -> Failure | None:
    """Every check of one segment on what was measured of it (host tensors); the strongest failure."""
    claim, token_idx, err = s.claim, s.token_idx, fig.err
    failures = [_strongest([check_hidden([st], off, t) for st, off in zip(stats, s.chunk_offsets)])]
    # sorted once for the pooled sums and the mean: the same values where the pooled clamp changes none
    ascending = err.sort().values if fig.worst <= 1e3 else None
    if s.evidence is not None:
        s.evidence.add(_evidence(stats, err, ascending))
    # one token near the line is honest bf16 noise (LOGPROB_OUTLIERS); more, or one far past it, is not
    if fig.over > LOGPROB_OUTLIERS or fig.worst >= PROOF_FACTOR * t.max_logprob_err:
        r = int(err.argmax())
        failures.append(Failure(Reason.LOGPROB_MISMATCH, f"claimed logprob {fig.claimed_lp[r].item():.4f}, recomputed "
                                f"{fig.ours[r].item():.4f} ({fig.over} tokens over {t.max_logprob_err})",
                                token=token_idx[r], severity=graded(fig.worst / t.max_logprob_err)))
    elif len(token_idx) >= MIN_MEAN_TOKENS:
        mean = _trimmed_mean_of_sorted(ascending if ascending is not None else err.sort().values)
        if mean > t.max_logprob_err_mean:
            failures.append(Failure(Reason.LOGPROB_MISMATCH, f"mean logprob error {mean:.4f} over "
                                    f"{len(token_idx)} tokens of version {s.spans[0].version}", token=token_idx[0],
                                    severity=graded(mean / t.max_logprob_err_mean)))
    if claim.engine not in SEEDED_ENGINES and claim.sampling.temperature > 0:
        return _strongest(failures)  # drawn from the engine's own generator: the checks above are what binds it
    if fig.any_sampling_bad:
        bad = fig.sampling_bad
        r = int(bad.nonzero()[0])
        failures.append(Failure(Reason.SAMPLING_MISMATCH, f"seeded sampling gives token {int(replay.tokens[r])} "
                                f"(margin {replay.margins[r].item():.3f}), claimed {int(fig.claimed_tok[r])}",
                                token=token_idx[r], severity=graded(float(replay.margins[bad].max()) / t.margin_noise)))
    return _strongest(failures)
