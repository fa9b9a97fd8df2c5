"""A verifiers environment as a run's task in `primerl-node sim`: every role (inference rolls out and
scores, validator recomputes the reward, trainer batches) loads it through `get_env`, and honest
work passes verification. The multi-turn env is used: its replies and rewards are replayed by each
role independently. The run whose reward rises is in benchmarks/results/verifiers-sim/."""

from __future__ import annotations

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers is not installed: pip install 'primerl-node[verifiers]'")

from node.sim import run_sim  # noqa: E402


@pytest.mark.slow(seconds=60)  # a whole network of processes: runs after the fast tests
def test_a_multi_turn_verifiers_env_trains_through_every_role_with_nothing_lost_or_rejected(tmp_path):
    s = run_sim(tmp_path, inference_nodes=1, steps=3, task="verifiers:digit-reverse-feedback", batch_groups=8,
                group_size=4, seed=3)
    assert s["status"] == "done" and s["steps"] == 3 and s["task"] == "verifiers:digit-reverse-feedback", \
        _log_tails(tmp_path)
    assert s["rollouts_trained"] == 3 * 8 * 4
    assert s["rollouts_lost"] == 0 and s["rollouts_duplicated"] == 0
    assert s["rollouts_rejected"] == 0 and s["honest_banned"] == 0  # the validator's rewards agree
    assert all(code == 0 for code in s["exit_codes"].values()), s["exit_codes"]


def _log_tails(out, lines: int = 15) -> str:
    """Each role's last log lines: what a timed-out sim was doing (CI keeps no files)."""
    parts = []
    for log in sorted(out.glob("*/log.txt")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"== {log.parent.name}\n" + "\n".join(tail))
    return "\n".join(parts)
