"""The trainer role under torchrun (`join --role trainer --dp 2 --ep 2`, gloo on CPU) trains a run
through every other role, and what it publishes is the one-process trainer's step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from node.model.checkpoint import load_hf_state_dict, state_dict_to_hf
from node.roles.common import fresh_model
from node.roles.trainer import TrainerNode
from node.rl.parallel.trainer import minibatch_seed
from node.rl.trainer import Trainer
from node.sim import run_sim
from protocol.coordinator import Coordinator
from protocol.identity import NodeKey
from protocol.messages import RunSpec
from shardcast.codec import unflatten
from shardcast.store import Store

PARAM_TOLERANCE = 1e-4
"""Largest |distributed - one process| per tensor over that tensor's largest |value|, after one
step (4 AdamW updates: 2 passes x 2 minibatches). Adam divides by sqrt(v), so float noise in tiny
gradients moves a few elements by up to ~lr (1e-3) and leaves the rest at ~1e-7 (measured: see
docs/scale-out.md); a wrong minibatch, learning rate or loss term moves the weights by ~lr over
whole tensors, well above this."""


def _published(out: Path, spec: RunSpec, version: int) -> dict[str, torch.Tensor]:
    store = Store(out / "trainer" / "shardcast")
    signed = store.manifest(spec.run_id, version)
    assert signed is not None, f"v{version} not in the trainer's store"
    return {k: t.clone() for k, t in unflatten(signed.manifest.tensors, store.payload(spec.run_id, version)).items()}


def _step_items(out: Path, spec: RunSpec, step: int) -> list[tuple]:
    """The rollout groups the trainer logged for `step`, read back from the coordinator's store."""
    rows = [json.loads(x) for x in (out / "trainer" / "metrics.jsonl").read_text().splitlines()]
    work_ids = next(r["work_ids"] for r in rows if r["step"] == step)
    state = Coordinator(out / "coordinator", spec)
    try:
        items = []
        for wid in work_ids:
            (task_index,), = state.store.q("SELECT task_index FROM work WHERE work_id=?", wid)
            items.append((wid, task_index, state.load_rollout(state.store.accepted(wid)[0])))
        return items
    finally:
        state.close()


def one_process_step(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """(published v1, the single-process trainer's weights after step 1 on the same batch from
    the published v0, its metrics)."""
    spec = RunSpec.model_validate_json((out / "coordinator" / "spec.json").read_bytes())
    role = TrainerNode(NodeKey.generate(), spec, "", out / "reference", 0)  # its config and batch building
    model = fresh_model(spec)
    load_hf_state_dict(model, _published(out, spec, 0))
    batch, _ = role.train_batch(_step_items(out, spec, 1))
    torch.manual_seed(minibatch_seed(int(spec.recipe["seed"]), 0))  # Trainer draws from the global generator
    metrics = Trainer(model, role.cfg).train_step(batch)
    return _published(out, spec, 1), state_dict_to_hf(model), metrics


def relative_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    assert sorted(got) == sorted(want)
    return {n: float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp(min=1e-12)) for n in want}


def test_dp2_ep2_trainer_trains_a_sim_and_publishes_the_one_process_step(tmp_path):
    s = run_sim(tmp_path, inference_nodes=1, steps=3, batch_groups=8, group_size=4, timeout_s=200,
                trainer_parallel="dp2-ep2")
    assert s["status"] == "done" and s["steps"] == 3, s
    assert s["rollouts_trained"] == 3 * 8 * 4
    assert s["rollouts_lost"] == 0 and s["rollouts_duplicated"] == 0
    assert all(code == 0 for code in s["exit_codes"].values()), s["exit_codes"]
    log = (tmp_path / "trainer" / "log.txt").read_text()
    assert "rank 0 of 2: leading" in log and "rank 1: stop from rank 0 at step 3" in log

    published, reference, metrics = one_process_step(tmp_path)
    before = relative_errors(_published(tmp_path, RunSpec.model_validate_json(
        (tmp_path / "coordinator" / "spec.json").read_bytes()), 0), reference)
    assert max(before.values()) > 10 * PARAM_TOLERANCE  # the step moved the weights well beyond the tolerance
    errors = relative_errors(published, reference)
    assert max(errors.values()) < PARAM_TOLERANCE, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    row = json.loads((tmp_path / "trainer" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["lr"] == pytest.approx(metrics["lr"])
    assert row["mismatch_kl"] == pytest.approx(metrics["mismatch_kl"], rel=1e-4, abs=1e-7)
