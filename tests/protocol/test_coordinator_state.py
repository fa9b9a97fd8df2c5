"""Coordinator rules without the network: leases, exactly-once acceptance, the off-policy bound."""

from __future__ import annotations

import pytest

from protocol import pipeline
from protocol.coordinator import Coordinator
from protocol.envelope import seal
from protocol.errors import (BannedPeer, DuplicateSubmission, LeaseExpired, NotLeaseHolder, NotMember, SpecMismatch,
                             StaleRollout, UnknownLease)
from protocol.identity import NodeKey
from protocol.ledger import OffPolicyLedger
from protocol.messages import Heartbeat, Join, RolloutSubmission, RunSpec
from protocol.work import derive_work, holder_seed

CK = NodeKey.from_seed(b"c" * 32)
A = NodeKey.from_seed(b"a" * 32)
B = NodeKey.from_seed(b"b" * 32)


def spec(k: int = 2, **kw) -> RunSpec:
    return RunSpec(run_id="r", coordinator=CK.peer_id, max_off_policy_steps=k, heartbeat_interval_s=10,
                   lease_ttl_s=100, **kw)


def rollout(work_id: int, versions: list[tuple[int, int]], reward: float = 1.0) -> RolloutSubmission:
    n = sum(length for _, length in versions)
    return RolloutSubmission(work_id=work_id, version_runs=versions, token_ids=list(range(n)), logprobs=[-0.5] * n,
                             reward=reward, proof=b"p" * 10, finish_reason="eos")


def submit(c: Coordinator, key: NodeKey, sub: RolloutSubmission, now: float):
    return c.submit(key.peer_id, sub, seal(key, "r", sub, now=now), now)


def beat(c: Coordinator, now: float) -> None:
    for key in (A, B):
        c.heartbeat(key.peer_id, Heartbeat(seq=int(now), role="inference"), now)


def open_run(tmp_path, k: int = 2, version: int = 0) -> Coordinator:
    c = Coordinator(tmp_path, spec(k), now=0)
    for key in (A, B):
        c.join(key.peer_id, Join(spec_hash=c.spec_hash, role="inference"), 0)
    for v in range(version + 1):
        c.advance_policy(v, "00" * 32, 0)
    return c


def test_result_is_accepted_exactly_once_and_a_retry_is_idempotent(tmp_path):
    c = open_run(tmp_path)
    g = c.grant_lease(A.peer_id, 1)
    sub = rollout(g.work_id, [(0, 4)])
    first = submit(c, A, sub, 2)
    assert first.accepted and not first.duplicate
    retry = submit(c, A, sub, 3)  # lost ack: the same rollout again
    assert retry.accepted and retry.duplicate
    with pytest.raises(DuplicateSubmission):  # a different rollout for the same work id
        submit(c, A, rollout(g.work_id, [(0, 4)], reward=0.0), 3)
    assert [r.work_id for r in c.accepted_rollouts()] == [g.work_id]


def test_late_submission_after_expiry_and_regrant_is_refused_with_a_reason(tmp_path):
    c = open_run(tmp_path)
    g = c.grant_lease(A.peer_id, 1)
    with pytest.raises(LeaseExpired):  # past the deadline, before any sweep
        submit(c, A, rollout(g.work_id, [(0, 3)]), g.deadline + 1)
    beat(c, g.deadline + 1)  # both members alive: the lease expires by its deadline alone
    dead, back = c.sweep(g.deadline + 1)
    assert dead == [] and back == [g.work_id]
    g2 = c.grant_lease(B.peer_id, g.deadline + 2)
    assert (g2.work_id, g2.task_index) == (g.work_id, g.task_index)  # same work, re-granted,
    assert g2.seed != g.seed  # with sampling seeds bound to the new holder (credit follows the work)
    with pytest.raises(NotLeaseHolder):
        submit(c, A, rollout(g.work_id, [(0, 3)]), g.deadline + 3)
    assert submit(c, B, rollout(g.work_id, [(0, 3)]), g.deadline + 3).accepted
    with pytest.raises(DuplicateSubmission):
        submit(c, A, rollout(g.work_id, [(0, 3)]), g.deadline + 4)
    with pytest.raises(UnknownLease):
        submit(c, A, rollout(999, [(0, 3)]), g.deadline + 4)


@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_off_policy_bound_at_the_edge(tmp_path, lag):
    """k=2: rollouts whose oldest token is k-1, k behind are accepted; k+1 behind is refused."""
    k, current = 2, 5
    c = open_run(tmp_path, k=k, version=current)
    g = c.grant_lease(A.peer_id, 1)
    sub = rollout(g.work_id, [(current - lag, 2), (current, 3)])  # mixed versions: the oldest counts
    if lag <= k:
        assert submit(c, A, sub, 2).accepted
    else:
        with pytest.raises(StaleRollout):
            submit(c, A, sub, 2)
        assert c.accepted_rollouts() == []
        # the refused unit is back in the pool at once: it holds none of A's lease cap until its deadline
        assert c.store.leased_count(A.peer_id) == 0
        assert c.grant_lease(A.peer_id, 3).work_id == g.work_id


def test_rollout_claiming_a_future_version_is_refused(tmp_path):
    c = open_run(tmp_path, version=1)
    g = c.grant_lease(A.peer_id, 1)
    with pytest.raises(StaleRollout):
        submit(c, A, rollout(g.work_id, [(2, 3)]), 2)


def test_stale_rollout_never_enters_a_batch(tmp_path):
    """Accepted within the bound, then versions move on: the batch builder drops it."""
    c = open_run(tmp_path, k=1, version=3)
    c.probation_units = 0  # A is past its probation (tests/protocol/test_probation.py)
    subs = {}
    for v in (2, 3, 3):
        g = c.grant_lease(A.peer_id, 1)
        subs[g.work_id] = v
        assert submit(c, A, rollout(g.work_id, [(v, 2)]), 2).accepted
    c.advance_policy(4, "11" * 32, 3)  # next batch is step 5, trains on version 4: lag(2)=2>1, lag(3)=1
    no_verdict_needed = lambda work_id: False  # noqa: E731 (verdicts: tests/protocol/test_pipeline.py)
    batch = pipeline.assign_batch(c, step=5, size=10, selector=no_verdict_needed)
    assert sorted(subs[w] for w in batch) == [3, 3]
    assert all(OffPolicyLedger(1, 4).admissible(subs[w], 5) for w in batch)
    assert [r.dropped for r in c.accepted_rollouts() if subs[r.work_id] == 2] == ["stale"]
    assert pipeline.assign_batch(c, step=5, size=10, selector=no_verdict_needed) == batch  # asked again: the same
    assert pipeline.assign_batch(c, step=6, size=10, selector=no_verdict_needed) == []  # at most one batch


def test_work_that_cannot_finish_in_time_is_cancelled_and_regranted(tmp_path):
    c = open_run(tmp_path, k=1, version=0)
    g = c.grant_lease(A.peer_id, 1)
    assert c.advance_policy(1, "22" * 32, 2) == []  # lag 1 <= k: still useful
    assert c.advance_policy(2, "33" * 32, 3) == [g.work_id]  # lag 2 > k: cancelled early
    with pytest.raises(LeaseExpired):
        submit(c, A, rollout(g.work_id, [(0, 3)]), 4)
    g2 = c.grant_lease(B.peer_id, 5)
    assert g2.work_id == g.work_id and g2.policy_version == 2
    assert submit(c, B, rollout(g.work_id, [(2, 3)]), 6).accepted


def test_task_and_seed_follow_from_run_step_and_work_id(tmp_path):
    c = open_run(tmp_path)
    grants = [c.grant_lease(A.peer_id, 1) for _ in range(5)]
    assert [g.work_id for g in grants] == list(range(5))
    for g in grants:
        task, seed = derive_work("r", 0, g.work_id, c.spec.tasks_per_step)
        assert (g.task_index, g.seed) == (task, holder_seed(seed, A.peer_id))
    assert len({g.seed for g in grants}) == 5
    assert derive_work("other-run", 0, 0, 1000) != derive_work("r", 0, 0, 1000)


def test_joins_bans_and_members(tmp_path):
    c = open_run(tmp_path)
    with pytest.raises(SpecMismatch):
        c.join(B.peer_id, Join(spec_hash="ff" * 32, role="inference"), 1)
    stranger = NodeKey.generate()
    with pytest.raises(NotMember):
        c.grant_lease(stranger.peer_id, 1)
    g = c.grant_lease(A.peer_id, 1)
    assert c.ban(A.peer_id, "failed verification", 2) == [g.work_id]
    with pytest.raises(BannedPeer):
        c.grant_lease(A.peer_id, 3)
    with pytest.raises(BannedPeer):
        c.join(A.peer_id, Join(spec_hash=c.spec_hash, role="inference"), 3)
    assert c.grant_lease(B.peer_id, 3).work_id == g.work_id  # honest member unaffected


def test_restart_keeps_everything_accepted(tmp_path):
    c = open_run(tmp_path, version=0)
    accepted = []
    for _ in range(5):
        g = c.grant_lease(A.peer_id, 1)
        submit(c, A, rollout(g.work_id, [(0, 2)]), 2)
        accepted.append(g.work_id)
    pending = c.grant_lease(A.peer_id, 1)
    c.close()
    seg = sorted((tmp_path / "rollouts").glob("seg-*.log"))[-1]
    size = seg.stat().st_size
    with open(seg, "ab") as f:  # a crash after the append, before the commit: never acknowledged
        f.write(b"\0\0\0\x0chalf-written")
    c = Coordinator(tmp_path, spec(2), now=3)
    assert [r.work_id for r in c.accepted_rollouts()] == accepted
    assert all(c.load_rollout(r).work_id == r.work_id for r in c.accepted_rollouts())
    assert seg.stat().st_size == size  # the unacknowledged tail is cut off
    assert c.ledger.current_version == 0
    assert A.peer_id in c.view.members  # membership survives the restart with a fresh interval
    assert submit(c, A, rollout(pending.work_id, [(0, 2)]), 4).accepted  # leases survive too
    with pytest.raises(SpecMismatch):
        Coordinator(tmp_path, spec(3))


def test_group_commit_accepts_each_work_once_within_a_batch(tmp_path):
    c = open_run(tmp_path)
    g1, g2 = c.grant_lease(A.peer_id, 1), c.grant_lease(B.peer_id, 1)
    s1, s2 = rollout(g1.work_id, [(0, 2)]), rollout(g2.work_id, [(0, 2)])
    other = rollout(g1.work_id, [(0, 3)])
    items = [(A.peer_id, s1, seal(A, "r", s1, now=2)), (B.peer_id, s2, seal(B, "r", s2, now=2)),
             (A.peer_id, s1, seal(A, "r", s1, now=2)), (A.peer_id, other, seal(A, "r", other, now=2)),
             (B.peer_id, s1, seal(B, "r", s1, now=2))]
    results = c.submit_many(items, 2)
    assert [type(r).__name__ for r in results] == ["SubmissionReceipt", "SubmissionReceipt", "SubmissionReceipt",
                                                  "DuplicateSubmission", "DuplicateSubmission"]
    assert results[2].duplicate and not results[0].duplicate
    assert [r.work_id for r in c.accepted_rollouts()] == [g1.work_id, g2.work_id]
    assert c.load_rollout(c.accepted_rollouts()[0]) == s1
