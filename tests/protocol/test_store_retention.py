"""Retention: the coordinator's store stays bounded over a long run, keeps what the status page and
a restart need, and a pruned work unit can still never be accepted twice."""

from __future__ import annotations

import pytest

from protocol import pipeline, segments
from protocol.coordinator import Coordinator
from protocol.envelope import seal
from protocol.errors import UnknownLease
from protocol.identity import NodeKey
from protocol.messages import Join, RolloutGroup, RolloutSubmission, RunSpec

CK = NodeKey.from_seed(b"c" * 32)
A = NodeKey.from_seed(b"a" * 32)
NO_VERDICTS = lambda work_id: False  # noqa: E731  (verdict gating: tests/protocol/test_pipeline.py)


def group(work_id: int, version: int, reward: float) -> RolloutGroup:
    sub = RolloutSubmission(work_id=work_id, version_runs=[(version, 3)], token_ids=[4, 5, 6], logprobs=[-0.1] * 3,
                            reward=reward, finish_reason="eos")
    return RolloutGroup(work_id=work_id, rollouts=[sub])


def open_run(tmp_path, retain: int) -> Coordinator:
    spec = RunSpec(run_id="r", coordinator=CK.peer_id, max_off_policy_steps=1, heartbeat_interval_s=3600,
                   lease_ttl_s=86_400, batch_groups=4, verification_rate=0.0)  # unverified: no probation
    return Coordinator(tmp_path, spec, synchronous="OFF", now=0, retain_versions=retain)


def test_a_long_run_keeps_a_bounded_store_and_the_status_totals(tmp_path, monkeypatch):
    monkeypatch.setattr(segments, "SEGMENT_BYTES", 1)  # every group commit starts a new segment file
    c = open_run(tmp_path, retain=3)
    c.join(A.peer_id, Join(spec_hash=c.spec_hash, role="inference"), 0)
    c.advance_policy(0, "00" * 32, 0)
    rewards, first_ids = {}, None
    for step in range(1, 31):  # step s trains on version s - 1 and publishes version s
        grants = pipeline.grant_leases(c, A.peer_id, 4, 1)
        first_ids = first_ids or [g.work_id for g in grants]
        units = [group(g.work_id, step - 1, reward=(step + i) / 100) for i, g in enumerate(grants)]
        receipts = c.submit_many([(A.peer_id, u, seal(A, "r", u, now=1)) for u in units], 1)  # one group commit
        assert all(r.accepted for r in receipts)
        assert len(pipeline.assign_batch(c, step, 4, NO_VERDICTS)) == 4
        rewards[step] = sum((step + i) / 100 for i in range(4)) / 4
        c.advance_policy(step, f"{step:064x}", step)
        # bounded: the index holds only the retained window (+ the batch in flight), and so does the disk
        assert len(c.accepted_rollouts()) <= 4 * (3 + 1)
        assert len(list((tmp_path / "rollouts").glob("seg-*.log"))) <= 3 + 2
    totals = c.store.totals()
    assert totals["accepted"] == totals["batched"] == 30 * 4  # the status page still counts every unit
    curve = dict(c.store.reward_curve())
    assert sorted(curve) == list(range(1, 31)) and all(curve[s] == pytest.approx(rewards[s]) for s in curve)
    assert [v for v, _, _ in c.store.policy_versions(last=100)] == [27, 28, 29, 30]
    # a late retry of pruned work is refused, never accepted a second time
    late = group(first_ids[0], 0, reward=1.0)
    with pytest.raises(UnknownLease):
        c.submit(A.peer_id, late, seal(A, "r", late, now=2), 2)
    # what is kept survives a restart and reads back verified
    kept = c.accepted_rollouts()
    c.close()
    c = open_run(tmp_path, retain=3)
    assert c.accepted_rollouts() == kept
    assert all(c.load_rollout(r).work_id == r.work_id for r in kept)
    assert c.store.totals()["accepted"] == 120
    c.close()


def test_unfinished_work_is_never_pruned(tmp_path):
    c = open_run(tmp_path, retain=1)
    c.join(A.peer_id, Join(spec_hash=c.spec_hash, role="inference"), 0)
    c.advance_policy(0, "00" * 32, 0)
    g = pipeline.grant_leases(c, A.peer_id, 1, 1)[0]
    unit = group(g.work_id, 0, reward=0.5)
    assert c.submit(A.peer_id, unit, seal(A, "r", unit, now=1), 1).accepted
    for v in range(1, 6):  # accepted, never batched nor dropped: its fate is open, it stays
        c.advance_policy(v, f"{v:064x}", v)
    assert [r.work_id for r in c.accepted_rollouts()] == [g.work_id]
    c.close()
