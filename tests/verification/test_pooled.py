"""The pooled check's rule (verification/pooled.py): a submission's summed evidence against bounds that
narrow as 1/sqrt(n); honest-sized figures pass, a shift of every figure fails, small pools are left to
the per-rollout bounds. (Its effect on real claims: tests/verification/test_cross_device.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

from verification.pooled import (LONG_8L, MIN_CHUNKS, NETWORK_8L_BF16, NETWORK_SMALL_FP8_ALL, SHORT, MIN_TOKENS,
                                 POOLED, POOLED_BY_SHAPE, Evidence, PooledBound, bounds_for, check_pooled, shape_of)
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


SHAPE_8L = "qwen3_moe:layers=8:hidden=2048:experts=128x768:top=8"
"""The 5.2B network's model (`random:qwen3-30b-a3b-8l`), which has its own pooled bounds."""


def test_a_served_shape_with_its_own_calibration_is_judged_by_it_and_any_other_by_the_precisions():
    from benchmarks.device_rollouts import config_of

    assert shape_of(config_of("qwen3-30b-a3b-8l")) == SHAPE_8L
    assert bounds_for("bfloat16", SHAPE_8L) is POOLED_BY_SHAPE[SHAPE_8L]["bfloat16"] != POOLED["bfloat16"]
    # the 48-layer shape, a shape nobody calibrated, no shape: the precision's bounds; float32: not pooled anywhere
    for shape in (shape_of(config_of("qwen3-30b-a3b-48l-e16")), "qwen3_moe:layers=3:hidden=8:experts=2x8:top=1", None):
        assert bounds_for("bfloat16", shape) is POOLED["bfloat16"]
    assert bounds_for("float32", SHAPE_8L) is None
    # a submission 1% of one layer's std away at 8 layers (session 33's pooled mantissa error: 1.02-1.20 ulps per
    # chunk over 16 chunks) passes the precision's bounds, set at 48 layers, and fails the shape's own
    tampered = _evidence(16, 2.0, 1.02, 300, 0.004)
    assert check_pooled(tampered, "bfloat16", 8) is None
    f = check_pooled(tampered, "bfloat16", 8, shape=SHAPE_8L)
    assert f is not None and f.reason == Reason.HIDDEN_MISMATCH and "mantissa" in f.detail
    # a shape's bounds hold up to the length their evidence measured: a longer submission gets the precision's
    own = POOLED_BY_SHAPE[SHAPE_8L]["bfloat16"]
    assert own.max_positions == NETWORK_8L_BF16 and bounds_for("bfloat16", SHAPE_8L, NETWORK_8L_BF16 + 1) \
        is POOLED["bfloat16"]
    assert POOLED_BY_SHAPE[SHAPE_8L]["fp8-all-bfloat16"].max_positions == LONG_8L  # FP8's evidence is shorter
    tampered.positions = NETWORK_8L_BF16
    assert check_pooled(tampered, "bfloat16", 8, shape=SHAPE_8L) is not None
    longer = _evidence(16, 2.0, 1.02, 300, 0.004)
    longer.add(Evidence(positions=NETWORK_8L_BF16 + 1))
    assert longer.positions == NETWORK_8L_BF16 + 1 and check_pooled(longer, "bfloat16", 8, shape=SHAPE_8L) is None


def test_the_5b_networks_own_honest_submissions_pass_the_shapes_bounds_at_every_length_they_reached():
    """Session 38's 5.2B network on an H200 (bf16, k = 2 and 1; the traced validator's evidence of every claim):
    each work unit judged as the validator judges it, by the shape's own bounds, which hold up to its longest."""
    from benchmarks.pooled_calibration import read

    results = Path(__file__).parents[2] / "benchmarks/results"
    rows = read(sorted(results.glob("network_evidence-5b-long-k*-h200-s38.jsonl.gz")))
    units: dict[tuple, Evidence] = {}
    for r in rows:
        assert r["passed_alone"] and r["precision"] == "bfloat16"
        units.setdefault((r["source"], r["work_id"], r["shape"]), Evidence()).add(
            Evidence(**{k: r[k] for k in ("chunks", "exp_mismatches", "mant_err", "tokens", "logprob_err",
                                          "positions")}))
    assert len(units) > 600 and all(shape == SHAPE_8L for *_, shape in units)
    longest = max(ev.positions for ev in units.values())
    assert LONG_8L < longest <= NETWORK_8L_BF16
    own = POOLED_BY_SHAPE[SHAPE_8L]["bfloat16"]
    for ev in units.values():
        assert bounds_for("bfloat16", SHAPE_8L, ev.positions) is own
        assert check_pooled(ev, "bfloat16", 8, shape=SHAPE_8L) is None


def test_the_small_networks_own_fp8_submissions_pass_the_shapes_bounds_at_every_length_they_reached():
    """Session 41's 0.52B network on an H100 (FP8 all, served form, k = 2; the traced validator's evidence): each work
    unit judged as the validator judges it, by the shape's own bounds, which hold up to its longest sequence; one
    position longer, the precision's."""
    from benchmarks.pooled_calibration import read

    shape = "qwen3_moe:layers=8:hidden=1024:experts=32x512:top=4"
    rows = read([Path(__file__).parents[2] / "benchmarks/results/network_evidence-small-fp8-served-k2-h100-s41.jsonl.gz"])
    units: dict[tuple, Evidence] = {}
    for r in rows:
        assert r["passed_alone"] and r["precision"] == "fp8-all-bfloat16" and r["shape"] == shape
        units.setdefault((r["work_id"], r["submitter"]), Evidence()).add(
            Evidence(**{k: r[k] for k in ("chunks", "exp_mismatches", "mant_err", "tokens", "logprob_err",
                                          "positions")}))
    assert len(units) > 250
    assert SHORT < max(ev.positions for ev in units.values()) == NETWORK_SMALL_FP8_ALL
    own = POOLED_BY_SHAPE[shape]["fp8-all-bfloat16"]
    assert bounds_for("fp8-all-bfloat16", shape, NETWORK_SMALL_FP8_ALL + 1) is POOLED["fp8-all-bfloat16"]
    for ev in units.values():
        assert bounds_for("fp8-all-bfloat16", shape, ev.positions) is own
        assert check_pooled(ev, "fp8-all-bfloat16", 8, shape=shape) is None
    # and they still fail the longest unit with its mantissa error at twice the bound's centre
    tampered = max(units.values(), key=lambda ev: ev.chunks)
    tampered = Evidence(tampered.chunks, tampered.exp_mismatches, tampered.chunks * 2.0 * own.mant_err_mean.centre,
                        tampered.tokens, tampered.logprob_err, tampered.positions)
    assert check_pooled(tampered, "fp8-all-bfloat16", 8, shape=shape) is not None


def test_the_shape_bounds_in_force_are_their_record_rounded_up():
    """`POOLED_BY_SHAPE` cites `verification/calibration/pooled.json` `by_shape`: each figure at or at most 2%
    above the record's (rounded up, never down), and every shape in force has a record."""
    record = json.loads((Path(__file__).parents[2] / "verification/calibration/pooled.json").read_text())["by_shape"]
    by_key = {r["key"]: r["calibration"] for r in record.values()}
    assert set(POOLED_BY_SHAPE) <= set(by_key)
    for shape, per_precision in POOLED_BY_SHAPE.items():
        for precision, t in per_precision.items():
            cal = by_key[shape][precision]["bounds"]
            for stat in ("exp_per_chunk", "mant_err_mean", "logprob_err_mean"):
                for part in ("centre", "width"):
                    got, want = getattr(getattr(t, stat), part), cal[stat][part]
                    assert want <= got <= 1.02 * want, (shape, precision, stat, part, got, want)


def test_honest_submissions_of_the_8_layer_shape_pass_its_bounds_and_one_tampered_layer_fails_them():
    """Session 33's evidence (1x H100, 32 submissions of 8 per case; bounds from sessions 28 and 33's honest claims):
    judged as the validator judges a unit, by the shape's bounds and by the precision's."""
    from benchmarks.pooled_calibration import read

    rows = read([Path(__file__).parents[2] / "benchmarks/results/detection_evidence-8l-128e-layer0-h100-s33.jsonl.gz"])
    units: dict[tuple, Evidence] = {}
    for r in rows:
        assert r["passed_alone"]
        units.setdefault((r["precision"], r["case"], r["work_id"]), Evidence()).add(
            Evidence(**{k: r[k] for k in ("chunks", "exp_mismatches", "mant_err", "tokens", "logprob_err")}))
    for precision in ("bfloat16", "fp8-all-bfloat16", "fp8-experts-bfloat16"):
        def rejected(case, shape):
            mine = [ev for (p, c, _), ev in units.items() if p == precision and c == case]
            assert len(mine) == 32
            return sum(check_pooled(ev, precision, 8, shape=shape) is not None for ev in mine)
        assert rejected("honest", SHAPE_8L) == 0 and rejected("honest", None) == 0
        assert rejected("noise1pct/layer0", SHAPE_8L) == 32, precision
        assert rejected("noise1pct/layer0", None) <= 1, precision


def test_a_zero_bound_passes_exact_agreement_and_fails_any_difference():
    """A centre and width of 0 (a path that agreed exactly, as CPU float32 does) divides nothing by zero."""
    from verification.pooled import PooledThresholds, ratio

    exact = {"float32": PooledThresholds(*(PooledBound(0.0, 0.0) for _ in range(3)))}
    assert ratio(0.0, 0.0) == 0.0 and ratio(0.1, 0.0) == math.inf
    assert check_pooled(_evidence(8, 0, 0, 100, 0), "float32", 2, exact) is None
    f = check_pooled(_evidence(8, 0, 0.5, 100, 0), "float32", 2, exact)
    assert f is not None and f.reason == Reason.HIDDEN_MISMATCH and f.severity == Severity.PROOF


def test_a_calibration_passes_every_honest_submission_even_where_its_statistic_is_far_from_normal():
    """`width / sqrt(n)` stands for a pooled mean's spread only near normality. On a path whose chunks mostly agree
    bit for bit (a float32 CPU network: the sim's evidence), a submission holding the few that differ sat above the
    bound its own evidence set (the sim test failed 1 run in 3). `cover` raises the centre to pass it; a submission
    further out still fails, and evidence near normal keeps the rule's own bounds."""
    from benchmarks.pooled_calibration import calibrate, caught

    def row(work_id: int, mant_err: float, case: str = "honest") -> dict:
        return {"precision": "float32", "case": case, "shape": "qwen3_moe:layers=2", "engine_device": "builtin",
                "judge_device": "cpu", "batch": "network", "work_id": work_id, "passed_alone": True, "chunks": 4,
                "exp_mismatches": 0, "mant_err": mant_err, "tokens": 0, "logprob_err": 0.0, "positions": 40}

    sparse = [row(w, 0.0) for w in range(60)] + [row(60, 1.0)]  # one chunk in 244 off by an ulp
    cal = calibrate(sparse, ("honest",))
    b = cal["float32"]["bounds"]["mant_err_mean"]
    assert b["centre_set_by"] == "the honest submission qwen3_moe:layers=2:builtin->cpu:bnetwork work 60"
    assert b["centre"] + b["width"] / 2 >= 0.25  # work 60's pooled mean, 1.0 over 4 chunks
    tampered = [row(100, 1.2, "noise")]
    judged = caught(sparse + tampered, cal)["float32 qwen3_moe:layers=2:builtin->cpu:bnetwork"]
    assert judged["honest"]["rejected"] == 0.0 and judged["noise"]["rejected"] == 1.0
    # the rule alone (before `cover`) had rejected work 60: its centre was 1.25 x the path mean
    rule_centre = round(1.25 * 1.0 / (61 * 4), 5)
    assert rule_centre + b["width"] / 2 < 0.25
    near_normal = [row(w, 0.3 + 0.02 * (w % 5)) for w in range(60)]
    cal = calibrate(near_normal, ("honest",))
    assert cal["float32"]["bounds"]["mant_err_mean"]["centre_set_by"] == "qwen3_moe:layers=2:builtin->cpu:bnetwork"
