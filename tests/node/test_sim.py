"""The whole network as OS processes on 127.0.0.1 (`primerl-node sim`), short runs.

The 20-minute run that reaches the reward target is `primerl-node sim --inference-nodes 4 --churn
--cheaters 1` (docs/node.md); here the same machinery runs a few steps so CI stays in budget.
"""

from __future__ import annotations

import json

import pytest

from node.sim import run_sim


def test_one_inference_node_trains_end_to_end_through_every_role(tmp_path):
    s = run_sim(tmp_path, inference_nodes=1, steps=4, batch_groups=8, group_size=4, timeout_s=150)
    assert s["status"] == "done" and s["steps"] == 4
    assert s["rollouts_trained"] == 4 * 8 * 4
    assert s["rollouts_lost"] == 0 and s["rollouts_duplicated"] == 0
    assert s["max_off_policy_seen"] <= s["max_off_policy_steps"] == 1
    assert s["honest_banned"] == 0 and s["rollouts_rejected"] == 0  # honest work passes verification
    assert all(code == 0 for code in s["exit_codes"].values()), s["exit_codes"]  # clean SIGTERM shutdown
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert (tmp_path / "report.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 4


@pytest.mark.slow
def test_churn_and_a_cheater_lose_nothing_and_ban_only_the_cheater(tmp_path):
    s = run_sim(tmp_path, inference_nodes=3, steps=12, batch_groups=8, group_size=4, churn=True, cheaters=1,
                timeout_s=240, seed=1)
    assert s["status"] == "done" and s["steps"] == 12
    assert s["coordinator_restarts"] == 1 and s["inference_kills"] >= 1
    assert s["rollouts_lost"] == 0 and s["rollouts_duplicated"] == 0
    assert s["cheaters"] == 1 and s["cheaters_banned"] == 1 and s["honest_banned"] == 0
    assert s["rollouts_rejected"] > 0
    assert s["max_off_policy_seen"] <= s["max_off_policy_steps"]


def test_synchronous_run_trains_only_on_the_newest_policy(tmp_path):
    s = run_sim(tmp_path, inference_nodes=2, steps=4, batch_groups=4, group_size=4, max_off_policy_steps=0,
                timeout_s=150, seed=2)
    assert s["status"] == "done" and s["steps"] == 4
    assert s["max_off_policy_seen"] == 0
    assert s["rollouts_lost"] == 0 and s["rollouts_duplicated"] == 0
