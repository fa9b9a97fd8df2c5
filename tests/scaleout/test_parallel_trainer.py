"""The distributed trainer (FSDP2 + EP + CP on gloo) computes one process's loss and gradients."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from node.rl.parallel import ParallelDims

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(nproc: int, layouts: str, out: Path, *extra: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "benchmarks.parallel_parity", "--layouts", layouts, "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _assert_matches_one_process(results: list[dict], layouts: str) -> None:
    expected = [ParallelDims(**{p[:2]: int(p[2:]) for p in text.split("-")}) for text in layouts.split(",")]
    assert [(r["layout"]["dp"], r["layout"]["ep"], r["layout"]["cp"]) for r in results] == [
        (d.dp, d.ep, d.cp) for d in expected]
    for r in results:
        assert r["missing"] == []
        assert abs(r["ref_loss"]) > 1e-3  # a loss that is not trivially zero
        assert r["loss_rel_err"] < 1e-5, r
        assert r["grad_rel_err"] < 1e-4, r
        # After one AdamW step: Adam divides by sqrt(v), so float noise in tiny gradients moves
        # a few parameters by up to ~lr; relative to the largest parameter that stays < 1e-3.
        assert r["param_rel_err"] < 1e-3, r


def test_two_processes_ep2_fsdp_and_cp2_match_one_process(tmp_path):
    layouts = "dp2-ep2,cp2"
    _assert_matches_one_process(_torchrun(2, layouts, tmp_path / "r.json"), layouts)


def test_micro_batches_of_a_token_budget_match_one_process_whole_batch(tmp_path):
    # 4 rows x 29 positions = 116 padded tokens; 40 a micro-batch: the rows in 3 chunks per rank
    layouts = "dp2-ep2,cp2"
    _assert_matches_one_process(_torchrun(2, layouts, tmp_path / "r.json", "--micro-batch-tokens", "40"), layouts)


@pytest.mark.slow
def test_four_processes_ep4_and_ep2_cp2_match_one_process(tmp_path):
    layouts = "dp4-ep4,dp2-ep2-cp2"
    _assert_matches_one_process(_torchrun(4, layouts, tmp_path / "r.json"), layouts)


def test_activation_checkpointing_and_ring_attention_match_one_process(tmp_path):
    """Each layer recomputed in the backward (its EP all-to-alls and CP ring too) changes nothing."""
    layouts = "dp2-ep2,cp2"
    _assert_matches_one_process(_torchrun(2, layouts, tmp_path / "r.json", "--activation-checkpointing"), layouts)


def test_adamw_on_its_multi_tensor_path_a_group_a_mesh_matches_one_process(tmp_path):
    """A GPU's AdamW default (foreach), here forced on the CPU: each parameter group holds one device mesh's
    parameters (`mesh_groups`), and the step is the one-process step's."""
    from node.rl.parallel.trainer import mesh_groups

    layouts = "dp2-ep2,cp2"
    results = _torchrun(2, layouts, tmp_path / "r.json", "--foreach")
    _assert_matches_one_process(results, layouts)
    assert [r["optimizer_groups"] for r in results] == [2, 2]  # two meshes in each layout: a group each
    from benchmarks.parallel_parity import check_model

    plain = check_model(aux_coef=0.0)  # one process, no mesh: one group
    assert [len(g["params"]) for g in mesh_groups(plain)] == [len(list(plain.parameters()))]


def test_without_fsdp_replicated_gradients_are_summed(tmp_path):
    layouts = "dp2-ep2,cp2"
    _assert_matches_one_process(_torchrun(2, layouts, tmp_path / "r.json", "--no-fsdp"), layouts)


def test_layouts_that_cannot_split_are_refused():
    with pytest.raises(ValueError, match="must divide"):
        ParallelDims(dp=2, ep=4)
    assert ParallelDims(dp=4, ep=2, cp=2).world == 8


def test_shard_batch_puts_every_token_on_exactly_one_rank():
    from benchmarks.parallel_parity import check_batch, check_model
    from node.rl.parallel.trainer import shard_batch

    class FakeGroups:  # coordinates only; shard_batch does no communication
        def __init__(self, dp_rank, cp_rank):
            self.dims, self.dp_rank, self.cp_rank = ParallelDims(dp=2, cp=2), dp_rank, cp_rank

    batch = check_batch(check_model(), rows=4, length=29)
    seen = torch.zeros_like(batch.input_ids)
    for d in range(2):
        for c in range(2):
            local = shard_batch(batch, FakeGroups(d, c))
            for i, row in enumerate(range(d * 2, d * 2 + 2)):
                for j, pos in enumerate(local.positions[i].tolist()):
                    if pos < 29:
                        assert local.batch.input_ids[i, j] == batch.input_ids[row, pos]
                        seen[row, pos] += 1
    assert bool((seen == 1).all())
    with pytest.raises(ValueError, match="does not split"):
        shard_batch(check_batch(check_model(), rows=3), FakeGroups(0, 0))
