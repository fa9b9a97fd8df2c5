"""The issue-26 GPU benchmarks at a tiny size on the CPU: the same code the H200 runs (`CudaEngine` eagerly,
served across rounds and versions; the validator's path; the device calibration), with the output fields
the device run is read by; and the TF32 guard of a float32 judge."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import detection_device, false_bans, pooled_calibration, verification_calibration
from node.replay import exact_float32

ROOT = Path(__file__).resolve().parents[2]


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_exact_float32_turns_tf32_off_and_restores_it():
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        with exact_float32(True):
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cuda.matmul.allow_tf32
        with exact_float32(False):  # bf16 / FP8 runs, CPU judges: left as they are
            assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.slow  # 13-19 s on the shared 2 cores (load 11-14)
def test_false_bans_on_served_engines_passes_honest_and_bans_cheaters(capsys):
    # builtin-cuda: the CUDA path's engines (one per precision for the whole run, versions by load_weights)
    assert false_bans.main(["--rollouts", "96", "--minutes", "4", "--hogs", "0", "--cheat-every", "2",
                            "--batches", "8,16", "--engine", "builtin-cuda", "--shape", "tiny",
                            "--precisions", "bfloat16,fp8-experts-bfloat16"]) == 0
    # not fp8-all-bfloat16: its mantissa-mean bound (4.3) rejects about 1% of honest CPU rollouts at the
    # device calibration's lengths (2 of 228 at 4.59, cpu-2core, 2026-12-02; docs/verification.md)
    r = _last_json(capsys)
    assert r["honest_rollouts_judged"] >= 96 and r["honest_rollouts_rejected"] == 0, r["rejections_by_reason"]
    assert r["honest_identities_banned"] == 0 and r["false_rejection_rate_upper_95"] < 0.06
    assert set(r["honest_rollouts_by_version"]) == {"v0", "v1"}  # both versions served by the same engines
    assert {s.split("/")[0] for s in r["honest_rollouts_by_setting"]} == {"bfloat16", "fp8-experts-bfloat16"}
    # at this 2-layer shape bf16 / FP8-experts cheaters are caught weakly (cpu-2core: 17 of 64 rejected, 3 of
    # 8 identities banned); the GPU run's shape is the 8-layer one
    assert sum(r["cheaters_banned"].values()) >= 1 and sum(r["cheater_rollouts_rejected"].values()) >= 8
    assert r["device"] == "cpu" and r["engine"] == "builtin-cuda" and r["shape"]["name"] == "tiny"
    assert {"device_name", "torch", "kernels", "numerics"} <= set(r["provenance"])


@pytest.mark.slow  # 10-32 s on the shared 2 cores (load 11-14): 16 engines
def test_detection_device_passes_honest_and_catches_engine_swaps(tmp_path, capsys):
    out = tmp_path / "det.json"
    evidence = tmp_path / "evidence.jsonl"
    assert detection_device.main(["--shape", "tiny", "--rollouts", "8", "--batch", "8", "--out", str(out),
                                  "--precisions", "bfloat16,fp8-all-bfloat16", "--evidence", str(evidence)]) == 0
    r = _last_json(capsys)
    assert r["rollouts_per_submission"] == 8 and set(r["pooled"]) == {"bfloat16", "fp8-all-bfloat16"}
    # each claim's evidence, and the pooled calibration over it: honest submissions pass the bounds in force
    assert pooled_calibration.main([str(evidence)]) == 0
    cal = _last_json(capsys)
    assert cal["claims"] == 8 * 2 * len(detection_device.cases_for("bfloat16"))
    for precision in ("bfloat16", "fp8-all-bfloat16"):
        assert cal["pooled_rejections_in_force"][f"{precision} tiny:cpu->cpu:b8"]["honest"]["rejected"] == 0.0
        assert cal["calibration"][precision]["honest_claims"] == {"tiny:cpu->cpu:b8": 8}
    assert json.loads(out.read_text())["detection"] == r["detection"]
    assert r["honest_rejected"] == {"bfloat16": 0.0, "fp8-all-bfloat16": 0.0}
    assert set(r["detection"]["bfloat16"]) == set(detection_device.cases_for("bfloat16")) - {"honest"}
    assert "plain_engine" in r["detection"]["fp8-all-bfloat16"] and "fp8_engine" in r["detection"]["bfloat16"]
    # the FP8 engine in a bf16 run, the plain engine in an FP8-all run, 1% noise in FP8-all: caught (cpu-2core: all 1.0)
    assert r["detection"]["bfloat16"]["fp8_engine"] >= 0.5
    assert r["detection"]["fp8-all-bfloat16"]["plain_engine"] >= 0.5
    assert r["detection"]["fp8-all-bfloat16"]["noise1pct/all"] >= 0.5
    assert r["provenance"]["device"] == "cpu" and r["shape"]["layers"] == 2
    plain = r["detection"]["fp8-all-bfloat16"]["plain_engine"]
    assert r["aims"]["plain_engine >= 0.90, fp8-all-bfloat16"] is (plain >= 0.9)


def test_device_calibration_writes_candidates_not_thresholds(tmp_path, capsys):
    thresholds = ROOT / "verification" / "calibration" / "thresholds.json"
    before = thresholds.read_bytes()
    out = tmp_path / "cal.json"
    assert verification_calibration.main(["--device", "cpu", "--shapes", "tiny", "--precisions", "bfloat16",
                                          "--tf32-shape", "tiny", "--rounds", "1:1,8:1", "--results", str(out)]) == 0
    r = _last_json(capsys)
    assert thresholds.read_bytes() == before and json.loads(out.read_text())["candidates"] == r["candidates"]
    assert [(c["shape"], c["precision"]) for c in r["cases"]] == [("tiny", "bfloat16"), ("tiny", "float32")]
    for case in r["cases"]:
        assert case["rollouts"] == 9 and case["paths"]["cpu"]["rollouts"] == 9
        assert case["paths"]["cpu"]["rejected"] == 0, case["paths"]["cpu"]["details"]
    for precision in ("bfloat16", "float32"):
        c = r["candidates"][precision]
        assert set(c["candidate"]) == set(c["in_force"]) == set(c["set_by"])
        assert all(c["candidate"][b] >= c["in_force"][b] for b in c["in_force"])
        assert c["measured"]["shapes"] == ["tiny"] and c["measured"]["paths"] == ["cpu"]
        assert c["measured"]["rollouts"] == 9 and c["measured"]["torch"] == torch.__version__
    assert r["shapes"]["tiny"]["params"] > 0 and r["provenance"]["torch"] == torch.__version__


@pytest.mark.slow(seconds=60)  # 41-133 s on the shared 2 cores (load 11-14): the device script's three steps, tiny, on the CPU
def test_xdevice_script_runs_every_step_on_the_cpu(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "TINY": "1", "OUT": str(tmp_path), "PY": sys.executable}
    subprocess.run(["bash", "benchmarks/xdevice_h200.sh"], cwd=ROOT, env=env, check=True, timeout=600,
                   capture_output=True)
    log = (tmp_path / "xdevice.log").read_text()
    for step in ("false_bans", "detection", "calibration"):
        assert f"{step} rc=0" in log, log
        assert json.loads((tmp_path / f"{step}.json").read_text())["provenance"]["device"] == "cpu"


def test_validator_speed_judges_the_engines_rollouts_and_reports_its_figures(capsys, tmp_path):
    from benchmarks import validator_speed

    prof = tmp_path / "round.prof"
    assert validator_speed.main(["--rollouts", "24", "--round", "8", "--batch", "8", "--profile", str(prof)]) == 0
    r = _last_json(capsys)
    assert (r["accepted"], r["rejected"], r["rollouts"]) == (24, 0, 24)
    assert r["gen_tok_s"] > 0 and r["judge_tok_s"] > 0 and 0 < r["prefill_share"] < 1
    # the ratio of the unrounded rates, against the ratio of the rounded ones: within one in the last place
    assert abs(r["verify_over_generate"] - r["judge_tok_s"] / r["gen_tok_s"]) <= 0.0015
    assert 0 <= r["gc_s"] < r["judge_s"] and r["ms_per_claim_without_gc"] <= r["ms_per_claim"]
    assert r["verify_over_generate_without_gc"] > 0 and 0 <= r["gen_gc_s"] < r["gen_s"]
    assert "check_segments" in prof.read_text()  # the profiled round went through the batched checks


def test_validator_speed_on_heavy_tailed_completions(capsys):
    from benchmarks import validator_speed
    from benchmarks.device_rollouts import R

    lengths = validator_speed.completion_lengths(400, 300, "pareto")
    assert min(lengths) >= 8 and max(lengths) == 300 and sorted(lengths)[200] < 60  # most short, some at the limit
    assert validator_speed.main(["--rollouts", "16", "--round", "8", "--batch", "8", "--new-tokens", "120",
                                 "--lengths", "pareto"]) == 0
    r = _last_json(capsys)
    assert (r["accepted"], r["rejected"], r["max_seq"]) == (16, 0, 144)
    assert r["completion_tokens_p50_max"][0] < r["completion_tokens_p50_max"][1] <= 120
    assert R.MAX_SEQ == 64  # the shared harness's positions restored


def test_publish_speed_publishes_a_full_version_then_deltas(capsys, tmp_path):
    from benchmarks import publish_speed

    assert publish_speed.main(["--gib", "0.02", "--versions", "2", "--store", str(tmp_path)]) == 0
    r = _last_json(capsys)
    assert [v["encoding"] for v in r["versions"]] == ["full", "delta", "delta"]
    assert all(v["wire_mib"] < r["versions"][0]["wire_mib"] / 4 for v in r["versions"][1:])
    assert r["delta_publish_s_median"] > 0 and r["copy_gb_s_one_thread"] > 0


def test_the_collector_clock_counts_the_collections_while_on_only():
    """`node.heap.Collections`: validator_speed's timed rounds and the validator role's rounds (`gc_s`)."""
    import gc

    from node.heap import Collections

    c = Collections()
    try:
        gc.collect()  # off: not counted
        c.on = True
        gc.collect()
        c.on = False
        gc.collect()
    finally:
        c.close()
    assert c.full == 1 and c.seconds > 0


@pytest.mark.slow  # 8 honest rollouts of up to 200 positions on the tiny shape, judged on the CPU
def test_detection_device_runs_longer_sequences_than_the_harness_and_records_their_positions(tmp_path, capsys):
    evidence = tmp_path / "evidence.jsonl"
    assert detection_device.main(["--shape", "tiny", "--rollouts", "8", "--batch", "8", "--precisions", "bfloat16",
                                  "--cases", "honest", "--max-seq", "200", "--new-tokens", "180",
                                  "--evidence", str(evidence)]) == 0
    r = _last_json(capsys)
    assert r["max_seq"] == 200 and r["honest_rejected"] == {"bfloat16": 0.0}
    rows = [json.loads(x) for x in evidence.read_text().splitlines()]
    assert len(rows) == 8 and all(x["positions"] > x["tokens_claimed"] > 0 for x in rows)  # the prompt counted too
    assert max(x["positions"] for x in rows) > 64 and all(x["positions"] <= 200 for x in rows)
