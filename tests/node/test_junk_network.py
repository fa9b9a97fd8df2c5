"""Junk from inference nodes against the whole network as OS processes (issue 29, attacks 2 and 3):
at verification rate 0, so nothing but admission and the trainer's own checks stand in the way, one
node sends groups claiming an unpublished version for their last token, one bare rollouts where the
run expects groups of 4, one a token outside the vocabulary (admission cannot know the vocabulary: the
trainer must drop those units). The run trains every step, the trainer never dies, the three are
banned, the honest node is not, and no rejected unit is ever trained on."""

from __future__ import annotations

import json

import pytest

from node.sim import run_sim
from protocol.store import CoordinatorStore


@pytest.mark.slow
def test_junk_units_never_reach_a_step_and_their_senders_are_banned(tmp_path):
    s = run_sim(tmp_path, inference_nodes=4, cheaters=3, steps=5, batch_groups=4, group_size=4, timeout_s=400,
                cheat_kinds=("future", "bare", "vocab"), run={"verification_rate": 0.0})
    assert s["status"] == "done" and s["steps"] == 5
    assert s["cheaters_banned"] == 3 and s["honest_banned"] == 0
    assert s["exit_codes"]["trainer"] == 0 and s["exit_codes"]["inference-0"] == 0
    assert all(s["exit_codes"][f"inference-{i}"] == 3 for i in (1, 2, 3))  # banned: exit code 3
    store = CoordinatorStore(tmp_path / "coordinator")
    try:
        rejected = {r.work_id for r in store.accepted() if r.dropped == "rejected_by_trainer"}
        trained = {w for line in (tmp_path / "trainer" / "metrics.jsonl").read_text().splitlines()
                   for w in json.loads(line)["work_ids"]}
        assert rejected and not rejected & trained  # the vocabulary junk reached the trainer, and no further
        bans = {p: store.ban_of(p)[0] for p in store.banned_peers()}
    finally:
        store.close()
    reasons = " ".join(bans.values())
    assert "UnpublishedVersion" in reasons and "MalformedWork" in reasons and "rejected by the trainer" in reasons
