"""benchmarks.trainer_scale runs the role's step (Leader/follow, streamed publication, fetch by another
process) and the cp ring-attention section on two gloo ranks with tiny shapes, and ends with one
JSON line holding every figure the H200 results file commits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_trainer_scale_runs_every_section_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "ts.json"
    cmd = [sys.executable, "-m", "benchmarks.trainer_scale", "--tiny", "--layers", "2", "--rows", "2", "--seq", "32",
           "--cp-layers", "2", "--cp-seq", "66", "--iters", "2", "--threads", "2", "--timeout", "150",
           "--store", str(tmp_path / "store"), "--log-dir", str(tmp_path), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=320)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary == r["summary"]
    for k in ("params_b", "state_gib_total", "mfu", "mfu_with_publish", "cp_tokens", "publish_gb_s", "peak_gib_per_gpu"):
        assert k in summary
    assert summary["cp_tokens"] == 66  # a sequence that does not divide by cp: padded, trained
    assert summary["publish_gb_s"] > 0 and summary["state_gib_total"] > 0
    scale = r["sections"]["scale"]
    assert "error" not in scale and "error" not in r["sections"]["cp"]
    assert scale["publish_full"]["bytes"] == scale["payload_bytes"]  # the other process got every byte
    assert len(scale["publish_overlapped"]) == 2
    assert all(x == x for x in scale["losses"])  # finite
