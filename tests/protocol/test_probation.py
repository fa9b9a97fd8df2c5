"""A new identity's work is on probation (issue 17, item 5: bound the damage of what passes): until
`PROBATION_UNITS` of its units entered a batch, each unit it submits is handed to the validators and
held out of every batch until its verdict, even when the run samples only some units for
verification. An honest newcomer's work is trained on once judged valid and then sampled like
everyone's; a tamperer's work is never trained on; runs without verification have no probation."""

from __future__ import annotations

from protocol import pipeline
from protocol.coordinator import PROBATION_UNITS, Coordinator
from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.messages import Join, RunSpec, Verdict
from test_pipeline import group

CK = NodeKey.from_seed(b"c" * 32)
HONEST, TAMPERER = NodeKey.from_seed(b"h" * 32), NodeKey.from_seed(b"t" * 32)
NONE_SAMPLED = lambda work_id: False  # noqa: E731  (a sampled run whose draw picked none of these units)


def open_run(tmp_path, rate: float = 0.1, batch_groups: int = 64) -> Coordinator:
    spec = RunSpec(run_id="r", coordinator=CK.peer_id, max_off_policy_steps=1, heartbeat_interval_s=1000,
                   lease_ttl_s=100, group_size=2, batch_groups=batch_groups, verification_rate=rate)
    c = Coordinator(tmp_path, spec, now=0)
    for key in (HONEST, TAMPERER):
        c.join(key.peer_id, Join(spec_hash=c.spec_hash, role="inference"), 0)
    c.advance_policy(0, "00" * 32, 0)
    return c


def submit(c: Coordinator, key: NodeKey, n: int) -> list[int]:
    ids = []
    for _ in range(n):
        g = group(c.grant_lease(key.peer_id, 1).work_id, 0)
        assert c.submit(key.peer_id, g, seal(key, "r", g, now=1), 1).accepted
        ids.append(g.work_id)
    return ids


def judge(c: Coordinator, key: NodeKey, ids: list[int], valid: bool) -> list:
    return pipeline.record_verdicts(c, "validator", [Verdict(work_id=w, submitter=key.peer_id, valid=valid,
                                                             reason="" if valid else "proof mismatch") for w in ids], 2)


def test_a_newcomers_work_waits_for_its_verdict_and_a_tamperers_is_never_trained_on(tmp_path):
    c = open_run(tmp_path)
    honest, tampered = submit(c, HONEST, 4), submit(c, TAMPERER, 4)
    assert all(r.probation for r in c.accepted_rollouts())
    assert pipeline.assign_batch(c, 1, 64, NONE_SAMPLED) == []  # nothing judged yet: nothing trained on
    assert pipeline.to_verify(c, 64, NONE_SAMPLED) == honest + tampered  # verified at rate 1.0 regardless
    assert judge(c, HONEST, honest[:2], True) == []
    assert pipeline.assign_batch(c, 1, 64, NONE_SAMPLED) == honest[:2]  # trained on after its verdict
    banned = [p for p, _ in judge(c, TAMPERER, tampered[:1], False)]
    assert banned == [TAMPERER.peer_id]
    c.ban(TAMPERER.peer_id, "failed verification", 2)
    assert judge(c, HONEST, honest[2:], True) == []
    assert pipeline.assign_batch(c, 2, 64, NONE_SAMPLED) == honest[2:]
    batched = {r.work_id for r in c.accepted_rollouts() if r.batch_step is not None}
    assert batched.isdisjoint(tampered)
    assert {r.dropped for r in c.accepted_rollouts() if r.work_id in tampered} == {"invalid", "banned"}


def test_without_probation_the_same_unsampled_tampered_unit_would_have_been_trained_on(tmp_path):
    """The peer: the rule above is what keeps the tamperer's unsampled work out."""
    c = open_run(tmp_path)
    c.probation_units = 0
    tampered = submit(c, TAMPERER, 2)
    assert pipeline.to_verify(c, 64, NONE_SAMPLED) == []
    assert pipeline.assign_batch(c, 1, 64, NONE_SAMPLED) == tampered


def test_probation_ends_after_enough_valid_batched_units_and_then_sampling_applies(tmp_path):
    c = open_run(tmp_path)
    first = submit(c, HONEST, PROBATION_UNITS)
    judge(c, HONEST, first, True)
    assert pipeline.assign_batch(c, 1, 64, NONE_SAMPLED) == first
    assert not c.on_probation(HONEST.peer_id) and c.on_probation(TAMPERER.peer_id)
    later = submit(c, HONEST, 2)
    assert not any(r.probation for r in c.accepted_rollouts() if r.work_id in later)
    assert pipeline.to_verify(c, 64, NONE_SAMPLED) == []  # sampled like everyone's now
    assert pipeline.assign_batch(c, 2, 64, NONE_SAMPLED) == later


def test_a_unit_accepted_on_probation_stays_on_it_after_its_submitter_earns_a_record(tmp_path):
    """A tamperer cannot slip units in while its first honest ones are being judged: probation is
    decided when a unit is accepted, not when it is batched."""
    c = open_run(tmp_path)
    c.probation_units = 2
    honest_first, slipped = submit(c, TAMPERER, 2), submit(c, TAMPERER, 3)
    judge(c, TAMPERER, honest_first, True)
    assert pipeline.assign_batch(c, 1, 64, NONE_SAMPLED) == honest_first
    assert not c.on_probation(TAMPERER.peer_id)
    assert pipeline.assign_batch(c, 2, 64, NONE_SAMPLED) == []  # the rest still wait for verdicts
    assert pipeline.to_verify(c, 64, NONE_SAMPLED) == slipped


def test_runs_without_verification_have_no_probation(tmp_path):
    c = open_run(tmp_path, rate=0.0)
    units = submit(c, HONEST, 2)
    assert c.probation_units == 0 and pipeline.assign_batch(c, 1, 64, NONE_SAMPLED) == units


def test_state_written_before_probation_existed_opens_and_its_units_are_not_on_probation(tmp_path):
    import sqlite3
    c = open_run(tmp_path)
    units = submit(c, HONEST, 1)
    c.close()
    db = sqlite3.connect(tmp_path / "coordinator.sqlite3")
    db.execute("ALTER TABLE accepted DROP COLUMN probation")
    db.commit()
    db.close()
    c = Coordinator(tmp_path, c.spec, now=0)
    assert [r.probation for r in c.accepted_rollouts()] == [False] and c.accepted_rollouts()[0].work_id == units[0]
