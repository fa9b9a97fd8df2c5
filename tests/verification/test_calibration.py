"""The thresholds in force sit above every honest maximum the committed calibration measured, and
the committed calibration was made with the thresholds now in force."""

import json
from dataclasses import asdict
from pathlib import Path

from verification.checks import THRESHOLDS

CAL = Path(__file__).parents[2] / "verification" / "calibration"


def test_thresholds_bound_the_committed_honest_maxima_and_match_the_calibration_run():
    result = json.loads((CAL / "thresholds.json").read_text())
    for precision, t in THRESHOLDS.items():
        rec = result["precisions"][precision]
        assert rec["in_force"] == asdict(t), f"{precision}: re-run the calibration after changing thresholds"
        h = rec["honest_max"]
        assert h["rollouts"] >= 300 and rec["honest_rejected"] == 0
        assert h["exp_mismatches_max"] <= t.max_exp_mismatches
        assert h["mant_err_mean_max"] <= t.max_mant_err_mean
        assert h["mant_err_median_max"] <= t.max_mant_err_median
        assert h["logprob_err_max_max"] <= t.max_logprob_err
        assert h["logprob_err_mean_max"] <= t.max_logprob_err_mean
        assert h["flip_margin_max_max"] <= t.margin_noise
        # and they still catch weight tampering in the calibration data (FP8 runs: also an unquantised engine),
        # as often as docs/verification.md says: on a bf16 base, FP8 experts' honest noise hides part of it,
        # and plain bf16's bounds widened for GPU->CPU drift (issue 26) let 2 of 64 1%-noise rollouts through
        tamper = rec["tamper_rejected_share"]
        for kind in ("noise1pct", "fp8" if not precision.startswith("fp8-") else "plain_engine"):
            assert tamper[kind] >= SHARES_BELOW_ONE.get(precision, {}).get(kind, 1.0), (precision, kind, tamper[kind])


def test_thresholds_bound_the_recorded_honest_maxima_of_other_devices():
    """`cross_device` records (another device's honest rollouts judged by this validator path) are
    covered too, with the mean the check applies (trimmed, rollouts of >= MIN_MEAN_TOKENS)."""
    result = json.loads((CAL / "thresholds.json").read_text())
    recorded = [(p, rec) for p, r in result["precisions"].items() for rec in r.get("cross_device", [])]
    assert recorded, "no cross-device record (issue 26)"
    for precision, rec in recorded:
        t, h = THRESHOLDS[precision], rec["honest_max"]
        assert h["rollouts"] >= 300 and rec["rejected_at_bounds_in_force"]["rejected"] == 0, rec["path"]
        assert h["exp_mismatches_max"] <= t.max_exp_mismatches
        assert h["mant_err_mean_max"] <= t.max_mant_err_mean
        assert h["mant_err_median_max"] <= t.max_mant_err_median
        assert h["logprob_err_max_max"] <= t.max_logprob_err
        assert h["logprob_err_checked_mean_max"] <= t.max_logprob_err_mean
        assert h["flip_margin_max_max"] <= t.margin_noise
        assert set(result["precisions"][precision]["bound_set_by"]) == set(asdict(t)), precision


def test_thresholds_bound_the_honest_maxima_of_the_gpu_calibrations():
    """GPU paths (the CUDA engine judged by the validator's GPU path: the 16-expert 48-layer shape, then the
    full Qwen3-30B-A3B shape) are covered by the bounds in force, with the checked (trimmed) mean."""
    result = json.loads((CAL / "thresholds.json").read_text())
    recorded = [(p, k, rec) for p, r in result["precisions"].items() for k, rec in r.items()
                if k.startswith("gpu_calibration")]
    assert any(k == "gpu_calibration_full_shape" for _, k, _ in recorded), "no full-shape GPU record (issue 26)"
    for precision, key, rec in recorded:
        t, h = THRESHOLDS[precision], rec["honest_max"]
        assert h["rollouts"] >= 300, (precision, key)
        assert h["exp_mismatches_max"] <= t.max_exp_mismatches, (precision, key)
        assert h["mant_err_mean_max"] <= t.max_mant_err_mean, (precision, key)
        assert h["mant_err_median_max"] <= t.max_mant_err_median, (precision, key)
        assert h["logprob_err_max_max"] <= t.max_logprob_err, (precision, key)
        assert h["logprob_err_checked_mean_max"] <= t.max_logprob_err_mean, (precision, key)
        assert h["flip_margin_max_max"] <= t.margin_noise, (precision, key)


SHARES_BELOW_ONE = {"fp8-experts-bfloat16": {"noise1pct": 0.5, "plain_engine": 0.06},
                   "fp8-all-bfloat16": {"plain_engine": 0.98}, "bfloat16": {"noise1pct": 0.9688}}
"""Per-submission detection below 1.0 in the committed calibration (docs/verification.md "FP8 runs",
"Cross-device fixture")."""


def test_committed_calibration_data_has_every_variation():
    data = json.loads((CAL / "data.json").read_text())
    names = set(data["cases"])
    for precision in ("float32", "bfloat16"):
        for batch in (1, 8, 32):
            for threads in (1, 2):
                assert f"honest/{precision}/batch{batch}/threads{threads}" in names
    assert all(len(rows) >= 32 for rows in data["cases"].values())


def test_committed_fp8_calibration_has_every_variation_on_the_cpu_path():
    data = json.loads((CAL / "data-fp8.json").read_text())
    names = set(data["cases"])
    for precision in (p for p in THRESHOLDS if p.startswith("fp8-")):
        for batch in (1, 8, 32):
            for threads in (1, 2):
                assert f"honest/{precision}/batch{batch}/threads{threads}" in names
        assert {f"tamper/{precision}/{k}" for k in ("noise1pct", "int8", "plain_engine")} <= names
    assert all(len(rows) >= 50 for rows in data["cases"].values())
