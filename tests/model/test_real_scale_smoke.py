"""`benchmarks.real_scale` at a tiny size on the CPU: the code the H200 call runs (checkpoint written as block-scaled
FP8, the launch stages, batch decode, the RL workload with proofs, the validator per claim and in submissions of 8),
with the fields that call is read by, so a broken benchmark is found here and not in device time."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from node.model.pretrained import smollm2_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a whole serve-and-judge pass of a 13M model (13 s alone on the 2 cores)
def test_real_scale_runs_end_to_end_on_the_cpu_and_reports_what_the_device_run_is_read_by(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "benchmarks.real_scale", "--dir", str(tmp_path / "ckpt"), "--write", "--device", "cpu",
           "--shape", "qwen3-moe-tiny", "--vocab-size", "49152", "--rl-requests", "16", "--decode-batch", "4",
           "--max-seq-len", "256", "--tokenizer-from", str(smollm2_dir()), "--release-engine"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OUT=str(out), OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "real_scale.json").read_text())
    assert result["decode_tok_s_b4"] > 0 and result["rl_workload_tok_s"] > 0 and result["launch_to_first_token_s"] > 0
    assert result["decode_tok_s_b4_fixed_tiles"] > 0 and result["decode_tok_s_b4_index_add"] > 0  # the variants
    # version 1 (the checkpoint's own e4m3 bytes and scales, the served form) into the serving engine and swapped
    applied = result["version_apply"]
    assert "version_apply_error" not in result and result["version_apply_s"] > 0
    assert applied["bytes"] > 0 and applied["apply_s"] > 0 and applied["staged_on_device"] is False  # the CPU copies in
    assert applied["weights_unchanged"] and applied["tensors_changed"] == []  # the same bytes, served as before
    assert applied["repeatable"] and applied["same_tokens"] and applied["logprob_diff_max"] == 0.0  # the CPU's sums
    # a sparse delta of version 1 (0.25% of the experts' e4m3 bytes) goes in as its changed bytes alone, and put
    # back it leaves exactly version 1's bytes
    delta = result["delta_apply"]
    assert "delta_apply_error" not in result and result["delta_apply_s"] > 0
    for v, changed in (("v2", True), ("v3", False)):
        assert delta[v]["changed_bytes"] > 0 and delta[v]["sparse_bytes"] == delta[v]["changed_bytes"], delta
        assert delta[v]["served_changed"] is changed, delta
    assert delta["restored_exact"] is True
    # the validator's resident model takes the same version 1: its step against version 0 holds nothing, and the
    # judging after it (pooled, calibration below) still passes every honest claim
    assert "validator_hold_error" not in result and result["validator_hold_s"] > 0
    assert result["validator_hold_step_bytes"] == 0
    for key in ("decode_profile_b4", "verify_profile"):  # where a decode step's / judging's time goes (operators here)
        profile = result[key]
        assert profile["wall_s_per_step"] > 0 and profile["kernels_s_per_step"] > 0, key
        top = profile["top"]
        assert top and all(k["us_per_step"] > 0 for k in top) and 0 < sum(k["share"] for k in top) <= 1.0001
    assert result["verify_rollouts"] == 16 and result["verify_rejected"] == 0, result.get("verify_rejected_detail")
    assert result["verify_units"] == 2 and result["verify_units_rejected"] == 0
    assert set(result["verify_evidence_max"]) == {"exp_per_chunk", "mant_err_mean", "logprob_err_mean"}
    # every honest claim's own figures against each bound in force: none crosses one (the CPU's paths agree)
    assert result["calibration"]["claims"] == 16
    bounds = result["calibration"]["bounds"]
    assert set(bounds) == {"max_exp_mismatches", "max_mant_err_mean", "max_mant_err_median", "max_logprob_err",
                           "max_logprob_err_mean", "margin_noise"}
    assert all(b["of"] > 0 and b["over_bound"] == 0 and b["candidate"] >= b["in_force"] for b in bounds.values()), bounds
    rows = [json.loads(x) for x in gzip.decompress((out / "real_scale-evidence.jsonl.gz").read_bytes()).splitlines()]
    assert len(rows) == 16 and all(r["case"] == "honest" and r["chunks"] > 0 for r in rows)
    assert all(0 < r["figures"]["tokens"] <= r["tokens_claimed"] for r in rows)
    # and `benchmarks.pooled_calibration` reads them: bounds from these honest claims, which pass them and those in force
    from benchmarks.pooled_calibration import calibrate, caught, in_force
    cal = calibrate(rows)
    assert set(cal) == {result["calibration"]["precision"]}
    for judged in (caught(rows, cal), caught(rows, in_force())):
        assert [v["honest"]["rejected"] for v in judged.values()] == [0.0], judged


def test_the_fingerprint_of_served_bytes_moves_with_any_one_byte_and_not_otherwise():
    """`fingerprint` is what stage 5's `weights_unchanged` rests on: one e4m3 byte moved, or two equal words
    swapped (the plain sum keeps them), changes it; the same bytes in a fresh copy do not."""
    import torch

    from benchmarks.real_scale import fingerprint

    torch.manual_seed(0)
    m = torch.nn.Module()
    m.register_buffer("q", torch.randn(300, 7).to(torch.float8_e4m3fn))  # 2,100 bytes: not a whole number of words
    m.w = torch.nn.Parameter(torch.randn(5, 3, dtype=torch.bfloat16))
    same = torch.nn.Module()
    same.register_buffer("q", m.q.clone())
    same.w = torch.nn.Parameter(m.w.detach().clone())
    base = fingerprint(m)
    assert fingerprint(same) == base and set(base) == {"q", "w"}
    m.q.view(-1).view(torch.uint8)[2099] ^= 1  # the last byte, in the padded word
    assert fingerprint(m)["q"] != base["q"] and fingerprint(m)["w"] == base["w"]
    m.q.view(-1).view(torch.uint8)[2099] ^= 1
    words = m.q.view(-1)[:2096].view(torch.uint8).view(torch.int32)
    words[0], words[1] = words[1].clone(), words[0].clone()  # the sum alone would not see a swap
    assert words[0] != words[1] and fingerprint(m)["q"][0] == base["q"][0] and fingerprint(m)["q"] != base["q"]
