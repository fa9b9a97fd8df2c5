"""From acceptance to a batch (protocol.pipeline): verdicts gate batches, failures ban, batches are
idempotent per step, the lease pool is throttled to (k + 1) batches of work."""

from __future__ import annotations

from protocol import pipeline
from protocol.coordinator import Coordinator
from protocol.envelope import open_envelope, seal
from protocol.identity import NodeKey
from protocol.messages import Join, RolloutGroup, RolloutSubmission, RunSpec, Verdict

CK = NodeKey.from_seed(b"c" * 32)
A = NodeKey.from_seed(b"a" * 32)
B = NodeKey.from_seed(b"b" * 32)
ALL = lambda work_id: True  # noqa: E731  (every unit needs a verdict, as in tests per DESIGN)


def open_run(tmp_path, k: int = 1, batch_groups: int = 2) -> Coordinator:
    spec = RunSpec(run_id="r", coordinator=CK.peer_id, max_off_policy_steps=k, heartbeat_interval_s=10,
                   lease_ttl_s=100, group_size=2, batch_groups=batch_groups)
    c = Coordinator(tmp_path, spec, now=0)
    for key in (A, B):
        c.join(key.peer_id, Join(spec_hash=c.spec_hash, role="inference"), 0)
    c.advance_policy(0, "00" * 32, 0)
    return c


def group(work_id: int, version: int, reward: float = 0.5) -> RolloutGroup:
    subs = [RolloutSubmission(work_id=work_id, version_runs=[(version, 3)], token_ids=[4, 5, 6],
                              logprobs=[-0.1] * 3, reward=reward, finish_reason="eos") for _ in range(2)]
    return RolloutGroup(work_id=work_id, rollouts=subs)


def lease_and_submit(c: Coordinator, key: NodeKey, version: int) -> int:
    grant = pipeline.grant_leases(c, key.peer_id, 1, 1)[0]
    g = group(grant.work_id, version)
    assert c.submit(key.peer_id, g, seal(key, "r", g, now=1), 1).accepted
    return grant.work_id


def verdict(c: Coordinator, work_id: int, key: NodeKey, valid: bool) -> list:
    return pipeline.record_verdicts(c, "validator", [Verdict(work_id=work_id, submitter=key.peer_id, valid=valid,
                                                             reason="" if valid else "tokens_mismatch")], 2)


def test_unverified_work_waits_and_verified_work_enters_the_batch(tmp_path):
    c = open_run(tmp_path)
    w1, w2 = lease_and_submit(c, A, 0), lease_and_submit(c, B, 0)
    assert pipeline.to_verify(c, 10, ALL) == [w1, w2]
    assert pipeline.assign_batch(c, 1, 2, ALL) == []  # nothing judged yet: nothing batched
    assert verdict(c, w1, A, True) == []
    assert pipeline.assign_batch(c, 1, 2, ALL) == [w1]
    assert pipeline.to_verify(c, 10, ALL) == [w2]


def test_failed_verdict_drops_the_unit_and_names_the_submitter_to_ban(tmp_path):
    c = open_run(tmp_path)
    w1, w2 = lease_and_submit(c, A, 0), lease_and_submit(c, B, 0)
    offenders = verdict(c, w2, B, False)
    assert offenders and offenders[0][0] == B.peer_id
    assert verdict(c, w1, A, True) == []  # the honest one passes
    assert pipeline.assign_batch(c, 1, 2, ALL) == [w1]
    assert c.store.accepted(w2)[0].dropped == "invalid"


def test_verdict_naming_the_wrong_submitter_is_ignored(tmp_path):
    c = open_run(tmp_path)
    w1 = lease_and_submit(c, A, 0)
    assert verdict(c, w1, B, False) == []  # B did not submit w1: no ban of anyone, no verdict stored
    assert pipeline.to_verify(c, 10, ALL) == [w1]


def test_batch_for_a_step_is_idempotent_and_each_unit_enters_one_batch(tmp_path):
    c = open_run(tmp_path, batch_groups=4)
    ids = [lease_and_submit(c, A, 0) for _ in range(3)]
    for w in ids:
        verdict(c, w, A, True)
    first = pipeline.assign_batch(c, 1, 2, ALL)
    assert pipeline.assign_batch(c, 1, 2, ALL) == first  # a retried request gets the same units
    second = pipeline.assign_batch(c, 2, 2, ALL)
    assert not set(first) & set(second) and len(first) == 2


def test_stale_verified_work_never_enters_a_batch(tmp_path):
    c = open_run(tmp_path, k=1)
    w = lease_and_submit(c, A, 0)
    verdict(c, w, A, True)
    c.advance_policy(1, "11" * 32, 3)
    c.advance_policy(2, "22" * 32, 3)
    assert pipeline.assign_batch(c, 3, 1, ALL) == []  # lag (3-1)-0 = 2 > k = 1
    assert c.store.accepted(w)[0].dropped == "stale"


def test_lease_pool_is_throttled_to_a_batch_and_a_half_at_k1(tmp_path):
    c = open_run(tmp_path, k=1, batch_groups=4)
    grants = pipeline.grant_leases(c, A.peer_id, 10, 1)
    assert len(grants) == 6  # batch_groups + k * batch_groups / 2
    assert pipeline.grant_leases(c, B.peer_id, 10, 1) == []


def test_no_work_before_the_first_policy_version(tmp_path):
    spec = RunSpec(run_id="r", coordinator=CK.peer_id, group_size=2, batch_groups=2)
    c = Coordinator(tmp_path, spec, now=0)
    c.join(A.peer_id, Join(spec_hash=c.spec_hash, role="inference"), 0)
    assert pipeline.grant_leases(c, A.peer_id, 4, 1) == []


def test_stored_units_carry_the_signed_group_as_submitted(tmp_path):
    c = open_run(tmp_path)
    w = lease_and_submit(c, A, 0)
    item = pipeline.stored(c, [w])[0]
    opened = open_envelope(item.envelope, "r", None, max_skew_s=float("inf"))
    assert opened.signer == A.peer_id and opened.message == group(w, 0)


def test_a_rejoining_member_gets_its_earlier_leases_taken_back(tmp_path):
    c = open_run(tmp_path, k=1, batch_groups=4)
    held = pipeline.grant_leases(c, A.peer_id, 3, 1)
    c.join(A.peer_id, Join(spec_hash=c.spec_hash, role="inference"), 2)  # restarted after a crash
    regranted = pipeline.grant_leases(c, B.peer_id, 3, 3)
    assert [g.work_id for g in regranted] == [g.work_id for g in held]  # same work, new holder
    assert [g.task_index for g in regranted] == [g.task_index for g in held]
    assert not {g.seed for g in regranted} & {g.seed for g in held}  # seeds bound to the holder


def test_work_too_stale_for_any_batch_is_not_handed_to_validators(tmp_path):
    c = open_run(tmp_path, k=1)
    old, = [lease_and_submit(c, A, 0)]
    c.advance_policy(1, "11" * 32, 3)
    fresh = lease_and_submit(c, B, 1)
    c.advance_policy(2, "22" * 32, 3)  # next batch (step 3) admits min_version >= 1 only
    assert pipeline.to_verify(c, 10, ALL) == [fresh]
    assert c.store.accepted(old)[0].dropped == "stale"


def test_a_late_cancel_of_an_earlier_lease_does_not_cancel_its_regrant():
    from protocol.envelope import Opened
    from protocol.member import RunMember
    from protocol.messages import LeaseGrant, WorkCancel
    import asyncio

    spec = RunSpec(run_id="r", coordinator=CK.peer_id)
    member = RunMember(A, None, spec, "inference")  # no host needed for the gossip rule
    old = LeaseGrant(work_id=7, holder=A.peer_id, policy_version=2, task_index=1, seed=1, deadline=1e12)
    regrant = old.model_copy(update={"policy_version": 3})
    cancel = WorkCancel(work_ids=[7], policy_version=3)  # arrives by gossip after the re-grant
    asyncio.run(member._on_gossip(Opened(message=cancel, signer=CK.peer_id, signer_public=CK.public_bytes, timestamp_ms=0, nonce=b"", body=b"", raw=b"")))
    assert member.lease_cancelled(old) and not member.lease_cancelled(regrant)



def test_no_lease_to_a_node_whose_policy_could_not_yield_admissible_work(tmp_path):
    c = open_run(tmp_path, k=0, batch_groups=2)
    c.advance_policy(1, "11" * 32, 2)
    assert pipeline.grant_leases(c, A.peer_id, 1, 2, holds_version=0) == []  # has not loaded v1 yet
    assert len(pipeline.grant_leases(c, A.peer_id, 1, 2, holds_version=1)) == 1
