"""Who may judge, and what a verdict can do (issue 17, item 1): only the spec's validators (or the
coordinator's own key) pull work to verify or send verdicts; a unit's verdict is recorded once; a ban
follows only from the verdict just recorded; borderline failures are strikes; the trainer recomputes
cheap rewards; a run.toml without trainer, or verifying without validators, is refused at launch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from protocol_testnet import make_spec, run, start_coordinator, start_member, stop_all

from protocol import pipeline
from protocol.errors import NotAuthorized
from protocol.identity import NodeKey
from protocol.messages import Join, Verdict, VerdictBatch, VerifyRequest, StoredWorkBatch, Ok
from test_pipeline import ALL, A, B, lease_and_submit, open_run


def _verdict(c, work_id: int, key: NodeKey, valid: bool, severity: str = "proof", validator: str = "v") -> list:
    return pipeline.record_verdicts(c, validator, [Verdict(work_id=work_id, submitter=key.peer_id, valid=valid,
                                                           reason="" if valid else "x", severity=severity)], 2)


def test_a_second_verdict_on_a_judged_or_batched_unit_changes_nothing_and_bans_nobody(tmp_path):
    c = open_run(tmp_path)
    w1, w2 = lease_and_submit(c, A, 0), lease_and_submit(c, B, 0)
    assert _verdict(c, w1, A, True) == []
    assert _verdict(c, w1, A, False, validator="forger") == []  # the red-team attack (a): no ban
    assert c.store.verdict_of(w1) == (True, "v", "")  # the recorded verdict stands
    assert pipeline.assign_batch(c, 1, 1, ALL) == [w1]
    # a verdict on a unit already trained on (without one) is ignored too
    c2 = open_run(tmp_path / "2")
    c2.probation_units = 0  # A is past its probation (tests/protocol/test_probation.py)
    w = lease_and_submit(c2, A, 0)
    assert pipeline.assign_batch(c2, 1, 1, lambda _: False) == [w]  # not selected: batched unjudged
    assert _verdict(c2, w, A, False) == [] and c2.store.verdict_of(w) is None
    # the honest verdict on B's unit still bans B when it fails
    assert [p for p, _ in _verdict(c, w2, B, False)] == [B.peer_id]


def test_borderline_failures_are_strikes_and_a_proof_grade_one_bans_at_once(tmp_path):
    c = open_run(tmp_path, batch_groups=16)
    units = [lease_and_submit(c, A, 0) for _ in range(pipeline.STRIKES_TO_BAN)]
    for i, w in enumerate(units):
        offenders = _verdict(c, w, A, False, severity="borderline")
        assert (offenders != []) == (i == pipeline.STRIKES_TO_BAN - 1)
        assert c.store.accepted(w)[0].dropped == "invalid"  # a borderline unit is never trained on either
    assert "3 strikes" in offenders[0][1] and "near a tolerance" in offenders[0][1]
    w = lease_and_submit(c, B, 0)
    assert [p for p, _ in _verdict(c, w, B, False, severity="proof")] == [B.peer_id]


def test_only_the_spec_validators_or_the_coordinator_may_pull_work_or_judge_over_the_wire(tmp_path):
    async def body():
        ck, named = NodeKey.generate(), NodeKey.generate()
        spec = make_spec(ck, run_id="judge", validators=[named.peer_id])
        coord = await start_coordinator(tmp_path, ck, spec)
        await coord.announce_policy(0, "aa" * 32)
        honest = await start_member(spec, coord.host.addrs[0])
        forger = await start_member(spec, coord.host.addrs[0], role="validator")
        validator = await start_member(spec, coord.host.addrs[0], role="validator", key=named)
        try:
            for msg in (VerifyRequest(max_items=8),
                        VerdictBatch(verdicts=[Verdict(work_id=0, submitter=honest.key.peer_id, valid=False)])):
                with pytest.raises(NotAuthorized):
                    await forger.net.request(ck.peer_id, msg)
            assert isinstance(await validator.net.request(ck.peer_id, VerifyRequest(max_items=8)), StoredWorkBatch)
            assert isinstance(await validator.net.request(ck.peer_id, VerdictBatch(verdicts=[])), Ok)
            assert coord.state.store.banned_peers() == set()
        finally:
            await stop_all(coord, [honest, forger, validator])
    run(body())


def test_without_named_validators_no_member_may_judge(tmp_path):
    """The default the red team attacked: validators = [] let any member joined as "validator" judge."""
    async def body():
        ck = NodeKey.generate()
        coord = await start_coordinator(tmp_path, ck, make_spec(ck, run_id="judge0"))
        forger = await start_member(coord.spec, coord.host.addrs[0], role="validator")
        try:
            with pytest.raises(NotAuthorized):
                await forger.net.request(ck.peer_id, VerifyRequest(max_items=8))
        finally:
            await stop_all(coord, [forger])
    run(body())


def test_the_trainer_recomputes_a_cheap_reward_instead_of_trusting_the_submitter():
    """Red-team attack (b): an accomplice's group with rewards inflated to 1.0 was trained on as given."""
    from node.envs import get_env
    from node.model.tokenizer import CharTokenizer
    from node.roles.trainer import TrainerNode
    from protocol.messages import RolloutSubmission

    env, tok = get_env("reverse"), CharTokenizer()
    task = env.sample_task(3)
    wrong = tok.encode("nonsense")
    sub = RolloutSubmission(work_id=1, version_runs=[(0, len(wrong))], token_ids=wrong, logprobs=[-0.1] * len(wrong),
                            reward=1.0, finish_reason="eos")
    me = SimpleNamespace(env=env, tok=tok)
    honest = float(env.reward(task, tok.decode(wrong)))
    assert honest < 1.0 and TrainerNode._reward(me, task, sub) == honest
    costly = SimpleNamespace(env=SimpleNamespace(cheap_reward=False), tok=tok)
    assert TrainerNode._reward(costly, task, sub) == 1.0  # a costly reward rests on the validator's verdict


def test_launch_refuses_a_run_without_a_trainer_or_verifying_without_validators(tmp_path):
    import os
    import subprocess
    import sys

    from node.run_config import InvalidRunConfig, RunConfig, to_toml

    trainer, validator = NodeKey.generate().peer_id, NodeKey.generate().peer_id
    base = {"run_id": "r", "status_port": 0, "listen": "/ip4/127.0.0.1/tcp/0"}
    cases = {"no_trainer": ({"validators": [validator]}, "trainer"),
             "no_validators": ({"trainer": trainer}, "validators"),
             "ok": ({"trainer": trainer, "validators": [validator]}, None),
             "unverified": ({"trainer": trainer, "verification_rate": 0.0}, None)}
    for name, (over, refused) in cases.items():
        (tmp_path / f"{name}.toml").write_text(to_toml(base | over))
        if refused:
            with pytest.raises(InvalidRunConfig, match=refused):
                RunConfig.load(tmp_path / f"{name}.toml")
        else:
            RunConfig.load(tmp_path / f"{name}.toml")
    out = subprocess.run([sys.executable, "-m", "node.cli", "coordinator", "launch", "--config",
                          str(tmp_path / "no_trainer.toml"), "--state", str(tmp_path / "state")],
                         capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 2 and "trainer" in out.stderr and "Traceback" not in out.stderr
