"""Router replay across the network: routed experts travel with submissions, are checked by the
validator and replayed by the trainer (`primerl-node sim`, one inference node, a few steps)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from sim_reads import published, step_units

from node.model.checkpoint import load_hf_state_dict
from node.roles.common import fresh_model
from node.roles.trainer import TrainerNode
from node.sim import run_sim
from protocol.identity import NodeKey
from protocol.messages import RunSpec


@pytest.mark.slow  # a whole network of processes: runs after the fast tests
def test_every_trained_batch_replays_the_routes_the_inference_node_sent(tmp_path):
    s = run_sim(tmp_path, inference_nodes=1, steps=3, batch_groups=8, group_size=4)
    assert s["status"] == "done" and s["steps"] == 3
    assert s["rollouts_lost"] == 0 and s["rollouts_duplicated"] == 0
    assert s["rollouts_rejected"] == 0 and s["honest_banned"] == 0  # honest routes pass the routing check
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["router_replay"] is True and r["routed_rollouts"] == 8 * 4 for r in rows), rows
    # Step 1 trains on version 0's rollouts with version 0's weights: with the engine's routes
    # replayed the trainer recomputes the engine's logprobs (float32 CPU: exactly).
    assert rows[0]["mismatch_kl"] < 1e-6

    # What travelled is the engine's routing under version 0: the trainer's v0 weights, routing
    # freely, choose the same experts at every position of step 1's batch.
    spec = RunSpec.model_validate_json((tmp_path / "coordinator" / "spec.json").read_bytes())
    role = TrainerNode(NodeKey.generate(), spec, "", tmp_path / "reference", 0)
    items = step_units(tmp_path, spec, 1)
    batch, _ = role.train_batch(items)
    model = fresh_model(spec)
    load_hf_state_dict(model, published(tmp_path, spec, 0))
    with torch.no_grad():
        free = model(batch.input_ids).routed_experts
    real = batch.input_ids.ne(role.tok.pad_id)  # positions of the sequences, not their padding
    assert batch.routed_experts is not None
    assert torch.equal(free.sort(-1).values[real], batch.routed_experts.sort(-1).values[real])
    # One submission without routes (an engine that cannot capture them): the step routes freely.
    group = items[0].group
    bare = group.model_copy(update={"rollouts": [group.rollouts[0].model_copy(update={"routed_experts": None}),
                                                 *group.rollouts[1:]]})
    assert role.train_batch([replace(items[0], group=bare), *items[1:]])[0].routed_experts is None
