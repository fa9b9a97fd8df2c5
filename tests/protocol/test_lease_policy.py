"""Sybil resistance for leases (issue 17, item 2; protocol.pipeline.LeasePolicy): what an identity
may hold grows with its work that entered a batch and shrinks with leases it let expire; new
identities get few, short leases, and together never more than a quarter of the pool."""

from __future__ import annotations

from protocol import pipeline
from protocol.coordinator import Coordinator
from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.messages import Join, RunSpec
from test_pipeline import group

CK = NodeKey.from_seed(b"c" * 32)
POLICY = pipeline.LeasePolicy()
ALL = lambda work_id: True  # noqa: E731


def open_run(tmp_path, keys, batch_groups: int = 16) -> Coordinator:
    # unverified (the tests batch with a selector that picks nothing), hence no probation either
    spec = RunSpec(run_id="r", coordinator=CK.peer_id, max_off_policy_steps=1, heartbeat_interval_s=1000,
                   lease_ttl_s=100, group_size=2, batch_groups=batch_groups, verification_rate=0.0)
    c = Coordinator(tmp_path, spec, now=0)
    for key in keys:
        c.join(key.peer_id, Join(spec_hash=c.spec_hash, role="inference"), 0)
    c.advance_policy(0, "00" * 32, 0)
    return c


def lease(c, key, count: int, now: float = 1):
    return pipeline.grant_leases(c, key.peer_id, count, now, pipeline.peer_lease_cap(1, c.spec.batch_groups),
                                 policy=POLICY)


def test_a_new_identity_gets_few_short_leases_and_earns_more_with_batched_work(tmp_path):
    a = NodeKey.from_seed(b"a" * 32)
    c = open_run(tmp_path, [a])
    grants = lease(c, a, 1024)
    assert len(grants) == POLICY.new_allowance
    assert all(g.deadline == 1 + 100 * POLICY.newcomer_ttl_share for g in grants)  # short leases
    for g in grants[:2]:  # two units submitted, verified, batched: credit
        assert c.submit(a.peer_id, group(g.work_id, 0), seal(a, "r", group(g.work_id, 0), now=1), 1).accepted
    assert pipeline.assign_batch(c, 1, 16, lambda _: False) == [g.work_id for g in grants[:2]]
    assert c.store.record_of(a.peer_id) == (2, 0)
    more = lease(c, a, 1024)
    held = 2  # the two unsubmitted leases
    assert len(more) + held == POLICY.allowance(2, 0, pipeline.peer_lease_cap(1, 16)) == 8
    assert all(g.deadline == 1 + 100 for g in more)  # a record earns full-length leases


def test_leases_let_expire_shrink_the_allowance_but_never_to_nothing(tmp_path):
    a = NodeKey.from_seed(b"a" * 32)
    c = open_run(tmp_path, [a])
    assert len(lease(c, a, 1024)) == 4
    c.sweep(1000)  # all four expire
    assert c.store.record_of(a.peer_id) == (0, 4)
    c.join(a.peer_id, Join(spec_hash=c.spec_hash, role="inference"), 1000)
    assert len(lease(c, a, 1024, now=1000)) == 1  # 4 - 2 x 4, floored at 1


def test_fresh_identities_together_never_hold_more_than_a_quarter_of_the_pool_and_earned_ones_still_get_work(tmp_path):
    honest = NodeKey.from_seed(b"h" * 32)
    sybils = [NodeKey.from_seed(bytes([i]) * 32) for i in range(10)]
    c = open_run(tmp_path, [honest, *sybils])
    pool = pipeline.out_limit(1, 16)  # 24
    for _ in range(3):  # the honest node earns a record first
        for g in lease(c, honest, 4):
            c.submit(honest.peer_id, group(g.work_id, 0), seal(honest, "r", group(g.work_id, 0), now=1), 1)
        pipeline.assign_batch(c, 1 + _, 16, lambda _: False)
    assert c.store.record_of(honest.peer_id)[0] >= 4
    taken = sum(len(lease(c, s, 1024)) for s in sybils for _ in range(3))
    assert taken == c.store.leased_by_newcomers() == pool * POLICY.newcomer_share == 6  # 10 sybils, one budget
    waiting = pipeline.work_out(c) - taken
    got = lease(c, honest, 1024)
    # the newcomers' leases take nothing from the earned identity: the pool less what waits for its
    # batch, up to its allowance
    cap = POLICY.allowance(*c.store.record_of(honest.peer_id), pipeline.peer_lease_cap(1, 16))
    assert len(got) == min(cap, pool - waiting) >= 8
