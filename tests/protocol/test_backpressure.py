"""Work in proportion to what the trainer can use (issue 28: `make run` dropped 21% of its accepted rollouts as
stale, generated, proved, verified and thrown away). A lease is granted only while every unit out keeps a
place in a batch it is admissible for (`protocol.pipeline.reachable_room`); units that can reach no batch are
dropped before a validator spends time on them. Real coordinator state (SQLite, segment files).
"""

from __future__ import annotations

from protocol import pipeline
from protocol.coordinator import Coordinator
from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.messages import Join, RolloutGroup, RolloutSubmission, RunSpec, Verdict

CK = NodeKey.from_seed(b"c" * 32)
NODE = NodeKey.from_seed(b"n" * 32)
NONE = lambda work_id: False  # noqa: E731  (no verdict needed: the schedule alone is under test)
B = 4


def open_run(tmp_path, k: int = 1) -> Coordinator:
    spec = RunSpec(run_id="r", coordinator=CK.peer_id, max_off_policy_steps=k, heartbeat_interval_s=1000,
                   lease_ttl_s=1000, group_size=2, batch_groups=B, verification_rate=0.0)
    c = Coordinator(tmp_path, spec, now=0)
    c.join(NODE.peer_id, Join(spec_hash=c.spec_hash, role="inference"), 0)
    c.advance_policy(0, "00" * 32, 0)
    return c


def submit(c: Coordinator, work_id: int, version: int) -> None:
    subs = [RolloutSubmission(work_id=work_id, version_runs=[(version, 3)], token_ids=[4, 5, 6], logprobs=[-0.1] * 3,
                              reward=0.5, finish_reason="eos") for _ in range(2)]
    g = RolloutGroup(work_id=work_id, rollouts=subs)
    assert c.submit(NODE.peer_id, g, seal(NODE, "r", g, now=1), 1).accepted


def lease_all(c: Coordinator, holds: int) -> list[int]:
    """Lease until the coordinator grants no more (as a greedy node asking 1,000 at a time would)."""
    out = []
    while grants := pipeline.grant_leases(c, NODE.peer_id, 1000, 1, holds_version=holds):
        out += [g.work_id for g in grants]
    return out


def test_no_lease_is_granted_for_a_batch_the_trainer_has_already_filled(tmp_path):
    c = open_run(tmp_path)
    first = lease_all(c, holds=0)
    for w in first:
        submit(c, w, 0)
    assert len(pipeline.assign_batch(c, 1, B, NONE)) == B  # the trainer takes batch 1 while v0 is newest
    # v0 rollouts may still enter batch 2 only: at most one batch of them may be out, less what is waiting
    more = lease_all(c, holds=0)
    assert len(first) - B + len(more) <= B
    for w in more:
        submit(c, w, 0)
    c.advance_policy(1, "11" * 32, 2)
    assert len(pipeline.assign_batch(c, 2, B, NONE)) == B
    assert c.store.totals()["dropped_stale"] == 0


def test_a_node_on_an_old_version_gets_no_lease_once_its_last_batch_is_full(tmp_path):
    c = open_run(tmp_path)
    for w in lease_all(c, holds=0):
        submit(c, w, 0)
    pipeline.assign_batch(c, 1, B, NONE)
    for w in lease_all(c, holds=0):
        submit(c, w, 0)
    c.advance_policy(1, "11" * 32, 2)
    pipeline.assign_batch(c, 2, B, NONE)
    # batch 2 is v0's last, and full: a node still holding v0 gets nothing, one holding v1 gets work
    assert c.store.batch_sizes(0).get(2) == B
    assert pipeline.grant_leases(c, NODE.peer_id, 8, 3, holds_version=0) == []
    assert pipeline.grant_leases(c, NODE.peer_id, 8, 3, holds_version=1)


def test_units_that_can_reach_no_batch_are_dropped_before_verification(tmp_path):
    c = open_run(tmp_path)
    early = lease_all(c, holds=0)
    for w in early:
        submit(c, w, 0)
    judged = set(early)
    needs_verdict = lambda w: w in judged  # noqa: E731  (v0 units wait for a validator, later ones do not)
    pipeline.record_verdicts(c, "validator", [Verdict(work_id=w, submitter=NODE.peer_id, valid=True)
                                              for w in early[:B]], 2)
    assert len(pipeline.assign_batch(c, 1, B, needs_verdict)) == B
    c.advance_policy(1, "11" * 32, 2)
    for w in lease_all(c, holds=1):
        submit(c, w, 1)
    # batch 2, the last one v0 units may enter, fills with v1 units while the v0 ones left await their verdict
    assert len(pipeline.assign_batch(c, 2, B, needs_verdict)) == B
    left = early[B:]
    assert left and all(c.store.accepted(w)[0].batch_step is None for w in left)
    assert not set(pipeline.to_verify(c, 100, needs_verdict)) & set(left)  # no validator time spent on them
    assert all(c.store.accepted(w)[0].dropped == "stale" for w in left)


def test_the_budget_follows_the_trainer_step_after_step(tmp_path):
    """A steady run: a node that always asks for all it can get, a trainer that takes each batch as soon as it
    is full; over 20 steps nothing accepted is dropped as stale and no step waits on an empty pool."""
    c = open_run(tmp_path)
    version = 0
    for step in range(1, 21):
        for w in lease_all(c, holds=version):
            submit(c, w, version)
        assert len(pipeline.assign_batch(c, step, B, NONE)) == B, f"step {step} short of work"
        version = step
        c.advance_policy(version, f"{step:064x}", 2 + step)
    totals = c.store.totals()
    assert totals["dropped_stale"] == 0 and totals["batched"] == 20 * B
