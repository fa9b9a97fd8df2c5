"""Validators are spot-checked (issue 17, item 1; protocol.judging): a sample of a validator's passing
verdicts, and every failing one, is re-verified by another seated validator before it counts; when
they disagree a third settles it, and the validator on the losing side loses its seat (its verdicts
stop counting, its requests are refused). Honest validators keep their seats."""

from __future__ import annotations

import pytest
from protocol_testnet import make_spec, run, start_coordinator, start_member, stop_all

from protocol import pipeline
from protocol.coordinator import Coordinator
from protocol.errors import NotAuthorized
from protocol.identity import NodeKey
from protocol.judging import JudgingPolicy, seated
from protocol.messages import Join, RunSpec, StoredWorkBatch, Verdict, VerifyRequest
from test_probation import submit

CK = NodeKey.from_seed(b"c" * 32)
NODE, CHEATER = NodeKey.from_seed(b"n" * 32), NodeKey.from_seed(b"x" * 32)
LIAR, HONEST1, HONEST2 = (NodeKey.from_seed(bytes([0xA0 + i]) * 32).peer_id for i in range(3))
ALL = lambda work_id: True  # noqa: E731
EVERY = JudgingPolicy(spot_check_rate=1.0)
NEVER = JudgingPolicy(spot_check_rate=0.0)


def open_run(tmp_path, validators: list[str]) -> Coordinator:
    spec = RunSpec(run_id="r", coordinator=CK.peer_id, max_off_policy_steps=1, heartbeat_interval_s=1000,
                   lease_ttl_s=100, group_size=2, batch_groups=64, validators=validators)
    c = Coordinator(tmp_path, spec, now=0)
    for key in (NODE, CHEATER):
        c.join(key.peer_id, Join(spec_hash=c.spec_hash, role="inference"), 0)
    for v in validators:
        c.join(v, Join(spec_hash=c.spec_hash, role="validator"), 0)
    c.advance_policy(0, "00" * 32, 0)
    return c


def say(c, validator: str, key: NodeKey, work_id: int, valid: bool, policy: JudgingPolicy = EVERY) -> list:
    return pipeline.record_verdicts(c, validator, [Verdict(work_id=work_id, submitter=key.peer_id, valid=valid,
                                                           reason="" if valid else "proof mismatch")], 2, policy)


def test_a_validator_failing_honest_work_loses_its_seat_and_the_honest_node_is_not_banned(tmp_path):
    c = open_run(tmp_path, [LIAR, HONEST1, HONEST2])
    [w] = submit(c, NODE, 1)
    assert say(c, LIAR, NODE, w, False) == []  # a failing opinion alone bans nobody: it needs a second
    assert c.store.verdict_of(w) is None and pipeline.assign_batch(c, 1, 64, ALL) == []
    assert pipeline.to_verify(c, 8, ALL, LIAR) == [] and pipeline.to_verify(c, 8, ALL, HONEST1) == [w]
    assert say(c, HONEST1, NODE, w, True) == []  # they disagree: a third validator settles it
    assert c.store.verdict_of(w) is None and pipeline.to_verify(c, 8, ALL, HONEST2) == [w]
    assert say(c, HONEST2, NODE, w, True) == []
    assert c.store.verdict_of(w)[0] is True and pipeline.assign_batch(c, 1, 64, ALL) == [w]
    assert seated(c) == [HONEST1, HONEST2] and "said invalid" in c.store.unseated()[LIAR]
    assert c.store.banned_peers() == set()
    [w2] = submit(c, NODE, 1)  # its verdicts stop counting
    assert say(c, LIAR, NODE, w2, False) == [] and c.store.opinions_of(w2) == []


def test_a_validator_passing_a_cheaters_work_is_caught_by_the_spot_check(tmp_path):
    c = open_run(tmp_path, [LIAR, HONEST1, HONEST2])
    [w] = submit(c, CHEATER, 1)
    assert say(c, LIAR, CHEATER, w, True) == []  # drawn for a spot check: not trained on yet
    assert pipeline.assign_batch(c, 1, 64, ALL) == []
    assert say(c, HONEST1, CHEATER, w, False) == []
    banned = say(c, HONEST2, CHEATER, w, False)
    assert [p for p, _ in banned] == [CHEATER.peer_id] and LIAR not in seated(c)
    assert c.store.accepted(w)[0].dropped == "invalid" and pipeline.assign_batch(c, 1, 64, ALL) == []


def test_honest_validators_keep_their_seats_and_agreeing_opinions_make_the_verdict(tmp_path):
    c = open_run(tmp_path, [HONEST1, HONEST2])
    good, bad = submit(c, NODE, 3), submit(c, CHEATER, 1)
    for w in good:
        say(c, HONEST1, NODE, w, True)
        say(c, HONEST2, NODE, w, True)
    say(c, HONEST2, CHEATER, bad[0], False)
    assert [p for p, _ in say(c, HONEST1, CHEATER, bad[0], False)] == [CHEATER.peer_id]  # two agree: the ban
    assert seated(c) == [HONEST1, HONEST2] and c.store.unseated() == {}
    assert pipeline.assign_batch(c, 1, 64, ALL) == good


def test_passing_verdicts_a_liar_gave_alone_are_withdrawn_when_it_is_caught(tmp_path):
    c = open_run(tmp_path, [LIAR, HONEST1, HONEST2])
    unchecked, caught = submit(c, CHEATER, 2)
    say(c, LIAR, CHEATER, unchecked, True, NEVER)  # not drawn for a check: its verdict alone stands...
    assert c.store.verdict_of(unchecked)[0] is True
    say(c, LIAR, CHEATER, caught, True)
    say(c, HONEST1, CHEATER, caught, False)
    say(c, HONEST2, CHEATER, caught, False)
    assert c.store.verdict_of(unchecked) is None  # ...until it is caught: judged again, not trained on
    assert pipeline.to_verify(c, 8, ALL, HONEST1) == [unchecked] and pipeline.assign_batch(c, 1, 64, ALL) == []


def test_two_validators_that_disagree_with_no_third_drop_the_unit_and_ban_nobody(tmp_path):
    c = open_run(tmp_path, [HONEST1, LIAR])
    [w] = submit(c, NODE, 1)
    say(c, LIAR, NODE, w, False)
    assert say(c, HONEST1, NODE, w, True) == []
    assert c.store.accepted(w)[0].dropped == "disputed" and c.store.banned_peers() == set()
    assert seated(c) == [HONEST1, LIAR]  # who lied cannot be told with two


def test_with_one_validator_a_failing_verdict_bans_at_once_as_before(tmp_path):
    c = open_run(tmp_path, [HONEST1])
    [w] = submit(c, CHEATER, 1)
    assert [p for p, _ in say(c, HONEST1, CHEATER, w, False)] == [CHEATER.peer_id]


def test_a_validator_that_lost_its_seat_is_refused_over_the_wire(tmp_path):
    async def body():
        ck, liar, honest = NodeKey.generate(), NodeKey.generate(), NodeKey.generate()
        spec = make_spec(ck, run_id="seats", validators=[liar.peer_id, honest.peer_id])
        coord = await start_coordinator(tmp_path, ck, spec)
        m_liar = await start_member(spec, coord.host.addrs[0], role="validator", key=liar)
        m_honest = await start_member(spec, coord.host.addrs[0], role="validator", key=honest)
        try:
            with coord.state.store as db:
                db.unseat(liar.peer_id, "said invalid on work 0, where 2 other validators said the opposite", 1)
            with pytest.raises(NotAuthorized, match="lost its validator seat"):
                await m_liar.net.request(ck.peer_id, VerifyRequest(max_items=8))
            assert isinstance(await m_honest.net.request(ck.peer_id, VerifyRequest(max_items=8)), StoredWorkBatch)
        finally:
            await stop_all(coord, [m_liar, m_honest])
    run(body())


def test_a_unit_waiting_on_a_liars_opinion_is_judged_on_without_it(tmp_path):
    """A three-way dispute in progress loses the liar's opinion when the liar is caught elsewhere: the
    unit then needs one more opinion from a seated validator, and the honest ones settle it."""
    c = open_run(tmp_path, [LIAR, HONEST1, HONEST2])
    w, other = submit(c, NODE, 2)
    say(c, LIAR, NODE, w, False)
    say(c, HONEST1, NODE, w, True)  # a tie: w waits for a third
    say(c, LIAR, NODE, other, False)
    say(c, HONEST2, NODE, other, True)
    say(c, HONEST1, NODE, other, True)  # the liar is caught on `other`
    assert LIAR not in seated(c) and c.store.opinions_of(w) == [(HONEST1, True, "", "proof")]
    assert pipeline.to_verify(c, 8, ALL, HONEST2) == [w]
    assert say(c, HONEST2, NODE, w, True) == [] and c.store.verdict_of(w)[0] is True
    assert sorted(pipeline.assign_batch(c, 1, 64, ALL)) == [w, other] and c.store.banned_peers() == set()


def test_strikes_expire_with_valid_work_so_rare_honest_noise_never_adds_up_to_a_ban(tmp_path):
    from protocol.judging import STRIKE_FORGIVEN_AFTER, STRIKES_TO_BAN

    c = open_run(tmp_path, [HONEST1])
    c.probation_units = 0

    def borderline(w):
        return pipeline.record_verdicts(c, HONEST1, [Verdict(work_id=w, submitter=NODE.peer_id, valid=False,
                                                             reason="near", severity="borderline")], 2, NEVER)
    for _ in range(STRIKES_TO_BAN + 1):  # a strike, then enough valid work to forget it, again and again
        assert borderline(submit(c, NODE, 1)[0]) == []
        for w in submit(c, NODE, STRIKE_FORGIVEN_AFTER):
            say(c, HONEST1, NODE, w, True, NEVER)
        assert c.store.strikes_of(NODE.peer_id) == 0
    strikes = [borderline(w) for w in submit(c, NODE, STRIKES_TO_BAN)]  # in a row: banned as before
    assert strikes[-1] and strikes[-1][0][0] == NODE.peer_id
