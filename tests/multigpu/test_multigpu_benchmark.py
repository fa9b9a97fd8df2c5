"""benchmarks.multigpu runs every section on gloo with tiny shapes (CPU), and its MFU arithmetic
counts the Qwen3-30B-A3B shape's published active parameters."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.fp8_common import qwen3_30b_a3b_config
from benchmarks.multigpu_work import train_flops_per_token

ROOT = Path(__file__).resolve().parents[2]
GLOO_ABORT_SIGNS = ("terminate called without an active exception", "Signal 6 (SIGABRT) received by PID")
"""How gloo's known abort under CPU contention shows in a section's tail (node/rl/parallel/dims.py)."""


def test_train_flops_count_the_published_active_parameters():
    cfg = qwen3_30b_a3b_config(48)
    matmul_params = train_flops_per_token(cfg, seq=0) / 6  # no attention-score term at seq 0
    active = matmul_params + cfg.vocab_size * cfg.hidden_size  # + the embedding row, as Qwen counts
    assert abs(active / 3.3e9 - 1) < 0.03  # Qwen3-30B-A3B: "3.3B activated"
    assert train_flops_per_token(cfg, seq=4096) > train_flops_per_token(cfg, seq=0)  # causal attention adds


@pytest.mark.slow(seconds=50)
@pytest.mark.timeout(2400)  # up to two runs of four sections, each under its own hang guard (--timeout)
def test_every_section_runs_on_two_cpu_ranks_and_matches_one_process(tmp_path):
    out = tmp_path / "mg.json"
    # the limits only catch a hang: a section takes seconds alone, a few times that on a loaded machine
    # (at 100 s per world and 170 s in all, this test was flaky under load)
    cmd = [sys.executable, "-m", "benchmarks.multigpu", "--tiny", "--gpus", "2", "--layers", "2", "--big-layers", "0",
           "--tokens", "128", "--seq", "64", "--rows", "2", "--batches", "1,3", "--new-tokens", "6", "--greedy-sampler",
           "--shardcast-gib", "0.02", "--timeout", "280", "--out", str(out)]
    for attempt in range(2):
        proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                              timeout=1150)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        r = json.loads(out.read_text())
        # gloo's known abort under CPU contention (a rank's std::terminate while its peer's socket closes;
        # node/rl/parallel/dims.py shutdown_distributed): seen once in 2 full suites on a loaded 2-core
        # machine. One more run then; any other error, or the same one twice, fails.
        # torchrun's report of that abort ("Signal 6 (SIGABRT)") can push the rank's own line out of the
        # 3,000-character tail (seen once more in session 18's fresh-clone suite): the same abort
        gloo_abort = any(sign in row.get("tail", "") for sign in GLOO_ABORT_SIGNS
                         for section in ("moe", "trainer", "engine") for row in r[section])
        if not gloo_abort:
            break
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == r["summary"]  # one JSON line last
    for section in ("moe", "trainer", "engine"):
        assert [row["gpus"] for row in r[section]] == [2], r[section]  # 1 vs 2: the same code, one world fewer
        assert not any("error" in row for row in r[section]), r[section]
    assert all(row["rel_err_vs_one_process"] < 1e-5 for row in r["moe"])  # EP all-to-all == one process (float32)
    assert [row["experts_per_gpu"] for row in r["moe"]] == [4]
    assert all(math.isfinite(x) for row in r["trainer"] for x in row["losses"])
    assert [row["layout"]["ep"] for row in r["trainer"]] == [2]
    assert all(b["decode_tok_s"] > 0 and b["forward_s"] > 0 for row in r["engine"] for b in row["rows"])
    assert r["shardcast"]["checksums_equal"] is True
    assert r["shardcast"]["end_to_end_s_per_gb"] > 0
