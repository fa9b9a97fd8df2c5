"""The distributed trainer (gloo, 2 processes) replays routed experts as one process does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.parallel_parity import check_batch, check_model, reference
from node.rl.trainer import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]


def test_replayed_routes_give_the_one_process_step_under_ep_fsdp_and_cp(tmp_path):
    out = tmp_path / "r.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "benchmarks.parallel_parity", "--layouts", "dp2-ep2,cp2", "--router-replay", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    # The replayed routes matter: routing freely gives another loss on the same batch.
    model = check_model()
    free_loss, _, _ = reference(model, check_batch(model, routes=True), TrainerConfig(router_replay=False))
    for r in results:
        assert r["missing"] == []
        assert abs(r["ref_loss"] - free_loss) > 1e-4, (r["ref_loss"], free_loss)
        assert r["loss_rel_err"] < 1e-5, r  # the tolerances of tests/scaleout/test_parallel_trainer.py
        assert r["grad_rel_err"] < 1e-4, r
        assert r["param_rel_err"] < 1e-3, r
