"""The simulation's adversary lives in its own module: the honest inference role has no cheating
hook installed, a cheater's hook tampers with about half its groups in the declared way, and the
adversary's program reaches the same `join` with the hook (tests/node/test_sim.py checks that the
validator catches every cheater and bans no honest node)."""

from __future__ import annotations

import ast
from pathlib import Path

from node.adversary import CHEATS, Cheater, main, tamper
from protocol.messages import RolloutGroup, RolloutSubmission

ROOT = Path(__file__).resolve().parents[2]


def group(work_id: int) -> RolloutGroup:
    subs = [RolloutSubmission(work_id=work_id, version_runs=[(3, 4)], token_ids=[5, 6, 7, 8], logprobs=[-0.5] * 4,
                              reward=0.25, finish_reason="eos") for _ in range(2)]
    return RolloutGroup(work_id=work_id, rollouts=subs)


def test_each_tamper_kind_changes_what_it_says_and_nothing_else():
    sub = group(1).rollouts[0]
    assert tamper(sub, "reward", 3).reward == 1.0 and tamper(sub, "reward", 3).token_ids == sub.token_ids
    assert tamper(sub, "tokens", 3).token_ids[1:] == sub.token_ids[1:] != tamper(sub, "tokens", 3).token_ids
    assert tamper(sub, "version", 3).version_runs == [(2, 4)] and tamper(sub, "version", 3).reward == sub.reward


def test_a_cheater_tampers_with_about_half_its_groups_and_only_their_first_rollout():
    honest = [group(w) for w in range(200)]
    out = Cheater("mixed", "peer")(honest, newest=3)
    changed = [o for o, h in zip(out, honest) if o != h]
    assert 60 < len(changed) < 140
    assert all(o.rollouts[1:] == h.rollouts[1:] for o, h in zip(out, honest))
    assert {k for k in CHEATS if any(tamper(h.rollouts[0], k, 3) == o.rollouts[0] for o, h in zip(out, honest))} \
        == set(CHEATS)


def test_the_honest_inference_role_holds_no_cheating_code():
    tree = ast.parse((ROOT / "node/roles/inference.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | \
        {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args}
    assert not {"tamper", "cheat", "CHEATS", "Cheater"} & names
    assert not any(isinstance(n, ast.ImportFrom) and n.module == "node.adversary" for n in ast.walk(tree))


def test_the_adversary_program_refuses_anything_but_an_inference_join(capsys):
    try:
        main(["--cheat", "reward", "join", "--role", "validator"])
        raise AssertionError("accepted a validator")
    except SystemExit as exc:
        assert exc.code == 2


def test_each_junk_kind_is_the_junk_it_says():
    from node.adversary import JUNK, junk
    from protocol.messages import decode_message, encode_message

    g = group(1)
    assert junk(g, "future", 3).rollouts[0].token_versions == [3, 3, 3, 1003]  # real versions, then the future
    assert junk(g, "vocab", 3).rollouts[0].token_ids[-1] == (1 << 31) - 1
    assert decode_message(encode_message(junk(g, "bare", 3))) == g.rollouts[0]  # a bare rollout on the wire
    assert len(junk(g, "short", 3).rollouts) == len(g.rollouts) - 1
    out = Cheater("vocab", "peer")([group(w) for w in range(100)], newest=3)
    assert 20 < sum(o != group(w) for w, o in enumerate(out)) < 80 and set(JUNK).isdisjoint(CHEATS)
