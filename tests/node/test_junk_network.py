"""Junk from inference nodes against the whole network as OS processes (issue 29, attacks 2 and 3):
at verification rate 0, so nothing but admission and the trainer's own checks stand in the way, one
node sends groups claiming an unpublished version for their last token, one bare rollouts where the
run expects groups of 4, one a token outside the vocabulary (admission cannot know the vocabulary: the
trainer must drop those units). The run trains every step, the trainer never dies, the three are
banned, the honest node is not, and no rejected unit is ever trained on."""

from __future__ import annotations

import json

import pytest

from node.sim import report, watch
from node.sim_config import SimConfig
from node.sim_network import start_network, stop_network
from protocol.store import CoordinatorStore

CHEATERS = ("inference-1", "inference-2", "inference-3")


@pytest.mark.slow(seconds=45)
def test_junk_units_never_reach_a_step_and_their_senders_are_banned(tmp_path):
    # The vocabulary junk is banned only once a batch the trainer drops holds it, which a loaded machine
    # may put after any fixed step: the run stops once 5 steps are done and the three cheaters have left
    # by themselves, and goes on to 40 steps (and fails below) if one never does. (15 was the cap until the
    # network got faster: session 13's run did its 15 steps in 26 s, all three banned only by then.)
    held = {}

    def enough(steps: int) -> bool:
        return steps >= 5 and all(held["net"].members[n].p.poll() is not None for n in CHEATERS)

    cfg = SimConfig(inference_nodes=4, cheaters=3, steps=40, batch_groups=4, group_size=4, timeout_s=600,
                    cheat_kinds=("future", "bare", "vocab"), run={"verification_rate": 0.0}, stop_when=enough)
    held["net"] = net = start_network(tmp_path, cfg)
    status, restarted = watch(net)
    stop_network(net, status)
    s = report(net, status, restarted)
    assert s["status"] == "stopped" and 5 <= s["steps"] < 40, s
    assert s["cheaters_banned"] == 3 and s["honest_banned"] == 0
    assert s["exit_codes"]["trainer"] == 0 and s["exit_codes"]["inference-0"] == 0
    assert all(s["exit_codes"][n] == 3 for n in CHEATERS)  # banned: exit code 3
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
