"""The pooled check's rule (verification/pooled.py): a submission's summed evidence against bounds that
narrow as 1/sqrt(n); honest-sized figures pass, a shift of every figure fails, small pools are left to
the per-rollout bounds. (Its effect on real claims: tests/verification/test_cross_device.py.)"""

from __future__ import annotations

import math

from verification.pooled import MIN_CHUNKS, MIN_TOKENS, POOLED, Evidence, PooledBound, check_pooled
from verification.reasons import Reason, Severity


def _evidence(chunks: int, exp: float, mant: float, tokens: int, lp: float) -> Evidence:
    """A submission whose chunks (tokens) each measured these per-chunk (per-token) means."""
    return Evidence(chunks=chunks, exp_mismatches=round(exp * chunks), mant_err=mant * chunks, tokens=tokens,
                    logprob_err=lp * tokens)


def test_the_bound_narrows_with_the_pool_towards_its_centre():
    b = PooledBound(centre=1.0, width=4.0)
    assert b.at(1) == 5.0 and b.at(16) == 2.0 and b.at(400) == 1.2
    assert b.at(0) == b.at(1)  # never a division by zero


def test_honest_sized_figures_pass_and_every_figure_shifted_fails():
    t = POOLED["bfloat16"]
    honest = _evidence(16, t.exp_per_chunk.centre / 1.25, t.mant_err_mean.centre / 1.25, 312,
                       t.logprob_err_mean.centre / 1.25)
    assert check_pooled(honest, "bfloat16", 8) is None
    lp_bound = t.logprob_err_mean.at(312)
    drift = _evidence(16, 0, 0, 312, 1.3 * lp_bound)
    f = check_pooled(drift, "bfloat16", 8)
    assert f is not None and f.reason == Reason.LOGPROB_MISMATCH and f.severity == Severity.BORDERLINE
    assert f.detail.startswith("pooled over 8 rollouts") and f"{lp_bound:.4f}" in f.detail
    hidden = _evidence(16, 2.5 * t.exp_per_chunk.at(16), 0, 312, 0)
    f = check_pooled(hidden, "bfloat16", 8)
    assert f is not None and f.reason == Reason.HIDDEN_MISMATCH and f.severity == Severity.PROOF


def test_small_pools_and_unpooled_precisions_are_left_to_the_rollout_bounds():
    far = _evidence(MIN_CHUNKS - 1, 100, 100, 10 * MIN_TOKENS, 1.0)
    assert check_pooled(far, "bfloat16", 1) is None
    assert "float32" not in POOLED and check_pooled(_evidence(64, 100, 100, 2000, 1.0), "float32", 8) is None
    # the logprob mean needs MIN_TOKENS; the hidden figures are still pooled over the chunks
    few_tokens = _evidence(MIN_CHUNKS, 0, 0, MIN_TOKENS - 1, 1.0)
    assert check_pooled(few_tokens, "bfloat16", 2) is None


def test_evidence_adds_up_and_its_means_are_per_chunk_and_per_token():
    a, b = _evidence(2, 3, 1.0, 40, 0.01), _evidence(6, 1, 2.0, 200, 0.02)
    a.add(b)
    m = a.means()
    assert a.chunks == 8 and a.tokens == 240
    assert m["exp_per_chunk"] == 12 / 8 and math.isclose(m["mant_err_mean"], (2 + 12) / 8)
    assert math.isclose(m["logprob_err_mean"], (0.4 + 4.0) / 240)
