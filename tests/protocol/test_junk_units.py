"""Junk work units (issue 29, attacks 2 and 3) against a real coordinator over libp2p: every claimed
version is checked at admission, the unit's type and shape too; each refusal is typed and a strike
against the sender (three ban it), while an honest member's work goes into the batch. Units the
trainer cannot train on leave the batch for good (a restarted trainer never gets them), and units that
no validator judges never hold the lease pool."""

from __future__ import annotations

import pytest
from protocol_testnet import client, make_spec, run, start_coordinator, start_member, stop_all

from protocol import pipeline
from protocol.coordinator import Coordinator
from protocol.envelope import seal
from protocol.errors import BannedPeer, MalformedWork, UnknownWork, UnpublishedVersion
from protocol.identity import NodeKey
from protocol.messages import Join, RolloutGroup, RolloutSubmission, RunSpec, UnitFailure, Verdict


def rollout(work_id: int, versions: list[int]) -> RolloutSubmission:
    return RolloutSubmission(work_id=work_id, version_runs=RolloutSubmission.runs_of(versions),
                             token_ids=[4 + i for i in range(len(versions))], logprobs=[-0.5] * len(versions),
                             reward=0.5, finish_reason="eos")


def group(work_id: int, versions: list[int], size: int = 2) -> RolloutGroup:
    return RolloutGroup(work_id=work_id, rollouts=[rollout(work_id, versions)] * size)


def test_junk_is_refused_at_admission_struck_and_banned_while_honest_work_is_batched(tmp_path):
    async def body():
        ck = NodeKey.generate()
        spec = make_spec(ck, group_size=2, batch_groups=4, heartbeat_interval_s=1.0, dead_after_missed=5)
        coord = await start_coordinator(tmp_path, ck, spec, policy_version=0)
        coord.selector = lambda work_id: False  # no verdicts needed here (tests/protocol/test_pipeline.py)
        coord.state.probation_units = 0
        coord.lease_policy = None  # nor a newcomer's budget (tests/protocol/test_lease_policy.py)
        boot = coord.host.addrs[0]
        attacker, honest = await start_member(spec, boot), await start_member(spec, boot)
        trainer = await start_member(spec, boot, role="trainer")
        try:
            bad = client(attacker)
            leases = await bad.lease(4)
            assert len(leases) >= 3
            # real versions for the first tokens, one nobody published for the last (the red team's unit)
            with pytest.raises(UnpublishedVersion):
                await bad.submit(group(leases[0].work_id, [0, 0, 0, 10**9]))
            with pytest.raises(MalformedWork):  # a bare rollout where the run expects a group of 2
                await bad.submit(rollout(leases[1].work_id, [0, 0]))
            assert coord.state.store.strikes_of(attacker.key.peer_id) == 2
            with pytest.raises(MalformedWork):  # a group of the wrong size
                await bad.submit(group(leases[2].work_id, [0, 0], size=3))
            assert coord.state.store.ban_of(attacker.key.peer_id) is not None
            with pytest.raises(BannedPeer):
                await bad.lease(1)
            # the attacker's leases are back in the pool: the honest member gets them, and its work is batched
            good = client(honest)
            grants = await good.lease(2)
            for g in grants:
                assert (await good.submit(group(g.work_id, [0, 0]))).accepted
            batch = await client(trainer).batch(1, 2)
            assert sorted(i.work_id for i in batch) == sorted(g.work_id for g in grants)
            assert coord.state.store.strikes_of(honest.key.peer_id) == 0
        finally:
            await stop_all(coord, [attacker, honest, trainer])
    run(body(), 120)


def test_a_unit_the_trainer_rejects_leaves_the_batch_for_good_and_its_sender_is_struck(tmp_path):
    async def body():
        ck = NodeKey.generate()
        spec = make_spec(ck, group_size=2, batch_groups=4, heartbeat_interval_s=1.0, dead_after_missed=5)
        coord = await start_coordinator(tmp_path, ck, spec, policy_version=0)
        coord.selector = lambda work_id: False
        coord.state.probation_units = 0
        coord.lease_policy = None
        boot = coord.host.addrs[0]
        sender, trainer = await start_member(spec, boot), await start_member(spec, boot, role="trainer")
        try:
            worker = client(sender)
            grants = await worker.lease(3)
            assert len(grants) == 3
            for g in grants:
                assert (await worker.submit(group(g.work_id, [0, 0]))).accepted
            t = client(trainer)
            first = [i.work_id for i in await t.batch(1, 2)]
            poison = first[0]
            await t.reject_units(1, [UnitFailure(work_id=poison, reason="token id outside the vocabulary")])
            await t.reject_units(1, [UnitFailure(work_id=poison, reason="a retry of a lost reply")])  # idempotent
            assert coord.state.store.strikes_of(sender.key.peer_id) == 1
            again = [i.work_id for i in await t.batch(1, 2)]  # a restarted trainer asks the same
            assert poison not in again and len(again) == 2 and first[1] in again  # topped up with the third
            assert coord.state.store.accepted(poison)[0].dropped == "rejected_by_trainer"
            with pytest.raises(UnknownWork):  # only units of that batch can be rejected
                await t.reject_units(2, [UnitFailure(work_id=again[0], reason="not in batch 2")])
            with pytest.raises(Exception) as refused:  # and only by the trainer
                await worker.reject_units(1, [UnitFailure(work_id=again[0], reason="a rival's unit")])
            assert type(refused.value).__name__ in ("NotAuthorized", "NotMember")
        finally:
            await stop_all(coord, [sender, trainer])
    run(body(), 120)


CK, A, B = (NodeKey.from_seed(bytes([c]) * 32) for c in b"cab")


def open_run(tmp_path) -> Coordinator:
    spec = RunSpec(run_id="r", coordinator=CK.peer_id, max_off_policy_steps=1, heartbeat_interval_s=3600,
                   lease_ttl_s=1000, group_size=2, batch_groups=2)
    c = Coordinator(tmp_path, spec, now=0)
    for key in (A, B):
        c.join(key.peer_id, Join(spec_hash=c.spec_hash, role="inference"), 0)
    c.advance_policy(0, "00" * 32, 0)
    return c


def fill_pool(c: Coordinator, key: NodeKey, now: float) -> list[int]:
    grants = pipeline.grant_leases(c, key.peer_id, 100, now)
    for g in grants:
        c.submit(key.peer_id, group(g.work_id, [0, 0]), seal(key, "r", group(g.work_id, [0, 0]), now=now), now)
    return [g.work_id for g in grants]


ALL = lambda work_id: True  # noqa: E731  (every unit needs a verdict)


def test_units_no_validator_judges_free_the_pool_after_the_limbo_and_strike_nobody(tmp_path):
    c = open_run(tmp_path)
    held = fill_pool(c, A, now=10)
    assert held and pipeline.grant_leases(c, B.peer_id, 1, 11) == []  # the pool is full of unjudged units
    limbo = pipeline.JUDGE_LIMBO_S
    assert pipeline.drop_unjudged(c, ALL, 10 + limbo - 1, limbo) == []  # not yet
    assert pipeline.drop_unjudged(c, ALL, 11 + limbo, limbo) == held  # no verdict at all for the limbo
    assert {c.store.accepted(w)[0].dropped for w in held} == {"unjudged"}
    assert c.store.strikes_of(A.peer_id) == 0
    assert pipeline.grant_leases(c, B.peer_id, 1, 12 + limbo)  # room again


def test_a_unit_skipped_while_later_ones_are_judged_is_dropped_and_a_slow_in_order_backlog_is_not(tmp_path):
    c = open_run(tmp_path)
    later = pipeline.grant_leases(c, B.peer_id, 1, 5)  # leased first, submitted last
    skipped, *rest = fill_pool(c, A, now=10)
    limbo = 100.0
    for w in rest:
        pipeline.record_verdicts(c, "v", [Verdict(work_id=w, submitter=A.peer_id, valid=True)], 300)
    # judged recently, and nothing accepted after `skipped` was judged yet: a backlog, not a skip
    assert pipeline.drop_unjudged(c, ALL, 350, limbo) == []
    g = later[0]
    c.submit(B.peer_id, group(g.work_id, [0, 0]), seal(B, "r", group(g.work_id, [0, 0]), now=400), 400)
    pipeline.record_verdicts(c, "v", [Verdict(work_id=g.work_id, submitter=B.peer_id, valid=True)], 401)
    assert pipeline.drop_unjudged(c, ALL, 402, limbo) == [skipped]  # a later unit was judged past it
