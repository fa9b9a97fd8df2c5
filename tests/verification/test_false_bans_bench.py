"""`benchmarks.false_bans` end to end at a tiny size: honest rollouts pass the real verification and
ban policy, both kinds of cheater are banned, and a cut run's checkpoint reports the same figures."""

from __future__ import annotations

import json
import math

from benchmarks import false_bans


def test_upper_bound_is_clopper_pearson():
    assert math.isclose(false_bans.upper_95(0, 100_096), 1 - 0.05 ** (1 / 100_096), rel_tol=1e-6)
    assert math.isclose(false_bans.upper_95(1, 100), 0.0466, abs_tol=2e-4)  # tabulated one-sided 95%
    assert false_bans.upper_95(0, 0) is None


def test_honest_rollouts_pass_and_both_cheaters_are_banned(tmp_path, capsys):
    ckpt = tmp_path / "fb.jsonl"
    # 96, not 48: at the bf16 bounds widened for GPU->CPU drift (issue 26), 48 gave the noise cheater 8 bf16
    # submissions, 2 rejected (borderline: 2 strikes, not banned); one run of 96 gave it 24, 12 rejected,
    # banned (cpu-2core). --minutes only catches a hang: 3 cut the run at 80 rollouts at load 15
    assert false_bans.main(["--rollouts", "96", "--minutes", "20", "--hogs", "0", "--cheat-every", "2",
                            "--batches", "16", "--round-rollouts", "16", "--checkpoint", str(ckpt)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["honest_rollouts_judged"] >= 96 and result["honest_rollouts_rejected"] == 0
    assert result["honest_identities_banned"] == 0
    # each kind banned; a cheater identity that joins in the last rounds may end the run unbanned
    assert all(1 <= result["cheaters_banned"][k] <= n for k, n in result["cheater_identities"].items()), result
    assert set(result["cheaters_banned"]) == {"noise", "relabel"}
    assert false_bans.main(["--report", str(ckpt)]) == 0
    cut = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert cut["cut"] and {k: cut[k] for k in ("honest_rollouts_judged", "cheaters_banned")} == \
        {k: result[k] for k in ("honest_rollouts_judged", "cheaters_banned")}
