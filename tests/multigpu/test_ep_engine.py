"""The engine with expert parallelism (one process per device, each holding 1/ep of the experts)
generates what the one-process engine generates, also while other ranks are idle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(nproc: int, out: Path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(__file__).with_name("ep_engine_worker.py")), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_ep_engine_on_two_ranks_matches_one_process_engine(tmp_path):
    ranks = _run(2, tmp_path / "r.json")
    assert [r["local_experts"] for r in ranks] == [4, 4]  # 8 experts split over 2 ranks
    for r in ranks:
        want0, want1 = r["want"]
        got0, after_bad, got1 = r["got"]
        assert got0 == want0  # same tokens, logprobs (4 decimals) and versions
        assert got1 == want1  # after a weight swap, each rank keeps its experts' rows of the new version
        assert all(v == [1] * len(v) for _, _, v in got1)
        assert after_bad == want0  # the rejected version left the weights as they were
        assert "shape" in r["rejected"]
    assert len(ranks[0]["got"][0]) == 3 and len(ranks[1]["got"][0]) == 1  # uneven work: rank 1 idles
    assert ranks[0]["got"][0] != ranks[1]["got"][0]
