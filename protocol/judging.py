"""Judging: validators' opinions on a work unit become its one verdict, and validators are spot-checked.

Invariants:
- a unit's verdict is recorded once and never changed, and only for a unit awaiting one (not batched,
  not dropped other than as stale); a ban follows only from the verdict just recorded: a proof-grade
  failure bans its submitter, a borderline one is a strike, and `STRIKES_TO_BAN` strikes ban;
- a verdict is recorded only when the opinions the unit needs agree. It needs one, or two when the
  unit was drawn for a spot check (`JudgingPolicy.spot_check_rate`, drawn by the coordinator after the
  first opinion arrived, so a validator cannot know which of its verdicts are checked) or its first
  opinion fails (a ban takes two validators), in both cases only while another seated validator is a
  live member (a run with one validator judges as before);
- opinions that disagree are settled by a third seated validator: the majority's opinion is the
  verdict and each validator on the other side loses its seat (`CoordinatorStore.unseat`): its
  requests are refused, its opinions on units without a verdict stop counting, and the passing
  verdicts it gave alone on units not yet batched are withdrawn (those units are judged again). With
  no third validator live, the unit is dropped as `disputed`: never trained on, nobody banned;
- until its verdict, a unit that needs one never enters a batch (`pipeline.assign_batch`).
The coordinator runs no model, so it cannot re-verify a unit itself: spot checks need two seated
validators, and telling which one lied needs three.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

from protocol.coordinator import Coordinator
from protocol.messages import Verdict
from protocol.store import CoordinatorStore

log = logging.getLogger(__name__)

STRIKES_TO_BAN = 3
"""Borderline failures (a few numeric differences near a tolerance, which honest hardware can
produce) an identity may collect before it is banned; one proof-grade failure bans at once."""
STRIKE_FORGIVEN_AFTER = 200
"""Valid verdicts of an identity, since its last strike, that take one strike away: honest numeric
noise is rare but never zero (bf16: 1 borderline failure in 2,048 honest rollouts with teacher-forced
routes, SECURITY.md), so strikes that never expired would ban every honest node in time; a node must
now fail 3 times within a few hundred units."""


@dataclass(frozen=True)
class JudgingPolicy:
    spot_check_rate: float = 0.1
    """Share of passing first opinions that a second seated validator must confirm before the unit
    may be trained on. A validator that passes a share f of bad units is caught after ~1/(0.1 f) lies."""
    confirm_failures: bool = True
    """A failing first opinion is confirmed by a second seated validator (when one is live) before
    it drops the unit or bans: one lying validator cannot ban an honest node alone."""


def seated(state: Coordinator) -> list[str]:
    """The spec's validators that have not lost their seat."""
    gone = state.store.unseated()
    return [v for v in state.spec.validators if v not in gone]


def live_checkers(state: Coordinator, exclude: set[str], now: float) -> list[str]:
    """Seated validators, other than `exclude`, that are live members (they will ask for work)."""
    return [v for v in seated(state) if v not in exclude and state.view.state(v, now) != "dead"]


def record_verdicts(state: Coordinator, validator: str, verdicts: list[Verdict], now: float,
                    policy: JudgingPolicy = JudgingPolicy(), draw: Callable[[], float] = random.random
                    ) -> list[tuple[str, str]]:
    """Count each verdict as `validator`'s opinion; record the unit's verdict once the opinions it
    needs agree; return (submitter, reason) of every peer to ban now. Ignored (and logged): a verdict
    from a validator that lost its seat, one naming the wrong submitter or an unknown unit, one on a
    unit that already has a verdict or this validator's opinion (a second one bans nobody), and one
    on a unit already batched or dropped (other than as stale: that race is the validator's)."""
    offenders: list[tuple[str, str]] = []
    with state.store as db:
        if validator in db.unseated():
            log.warning("%d verdicts from %s ignored: it lost its seat", len(verdicts), validator)
            return []
        for v in verdicts:
            rec = db.accepted(v.work_id)
            if not rec or rec[0].submitter != v.submitter:
                log.warning("verdict from %s on work %d names %s: no such accepted unit", validator, v.work_id,
                            v.submitter)
                continue
            if rec[0].batch_step is not None or rec[0].dropped not in (None, "stale"):
                log.warning("verdict from %s on work %d ignored: the unit is %s", validator, v.work_id,
                            "batched" if rec[0].batch_step is not None else f"dropped ({rec[0].dropped})")
                continue
            if db.verdict_of(v.work_id) is not None:
                log.warning("verdict from %s on work %d ignored: it already has one", validator, v.work_id)
                continue
            opinions = db.opinions_of(v.work_id)
            if validator in {o[0] for o in opinions}:
                log.warning("verdict from %s on work %d ignored: it gave its opinion already", validator, v.work_id)
                continue
            if not opinions:  # the first opinion: how many the unit needs is drawn now
                check = (not v.valid and policy.confirm_failures) or draw() < policy.spot_check_rate
                db.set_need(v.work_id, 2 if check and live_checkers(state, {validator}, now) else 1)
            db.add_opinion(v.work_id, validator, v.valid, v.reason, v.severity, now)
            opinions.append((validator, v.valid, v.reason, v.severity))
            if len(opinions) >= db.need_of(v.work_id):
                offenders += _settle(state, db, v.work_id, v.submitter, opinions, now)
    return offenders


def _settle(state: Coordinator, db: CoordinatorStore, work_id: int, submitter: str,
            opinions: list[tuple[str, bool, str, str]], now: float) -> list[tuple[str, str]]:
    """Enough opinions are in: record the verdict, ask a third validator, or drop the unit as disputed."""
    passing = [o for o in opinions if o[1]]
    failing = [o for o in opinions if not o[1]]
    if passing and failing:
        if len(passing) == len(failing):
            if live_checkers(state, {o[0] for o in opinions}, now):
                db.set_need(work_id, len(opinions) + 1)  # a tie-breaker
                return []
            log.warning("work %d: validators disagree (%s) and none is left to settle it; dropped as disputed",
                        work_id, ", ".join(f"{o[0]}: {'valid' if o[1] else 'invalid'}" for o in opinions))
            db.drop([work_id], "disputed")
            return []
        majority, minority = (passing, failing) if len(passing) > len(failing) else (failing, passing)
        validator, valid, reason, _ = majority[0]
        db.put_verdict(work_id, valid, validator, reason, now)  # first: the liar's withdrawal must not touch it
        offenders = _consequences(db, work_id, submitter, majority)
        for liar, said, why, _ in minority:
            offenders += _unseat(state, db, liar, f"said {'valid' if said else 'invalid'} ({why or 'no reason'}) on "
                                 f"work {work_id}, where {len(majority)} other validators said the opposite", now)
        return offenders
    validator, valid, reason, _ = opinions[0]
    db.put_verdict(work_id, valid, validator, reason, now)
    return _consequences(db, work_id, submitter, opinions)


def _unseat(state: Coordinator, db: CoordinatorStore, liar: str, why: str, now: float) -> list[tuple[str, str]]:
    """Take the liar's seat. An undecided unit that loses its opinion needs one more opinion than it
    has left from another live seated validator, or, with none live, is settled on what is left."""
    log.warning("validator %s loses its seat: %s", liar, why)
    withdrawn, undecided = db.unseat(liar, why, now)
    if withdrawn:
        log.warning("%d passing verdicts %s gave alone withdrawn: judged again", len(withdrawn), liar)
    offenders: list[tuple[str, str]] = []
    for w in undecided:
        left = db.opinions_of(w)
        if not left or live_checkers(state, {o[0] for o in left}, now):
            db.set_need(w, len(left) + 1)
        else:
            offenders += _settle(state, db, w, db.accepted(w)[0].submitter, left, now)
    return offenders


def _consequences(db: CoordinatorStore, work_id: int, submitter: str, opinions: list[tuple[str, bool, str, str]]
                  ) -> list[tuple[str, str]]:
    """A verdict was just recorded: a failing one drops the unit and bans, or counts a strike."""
    validator, valid, reason, _ = opinions[0]
    if valid:
        db.forgive(submitter, STRIKE_FORGIVEN_AFTER)
        return []
    db.drop([work_id], "invalid")
    if any(o[3] == "borderline" for o in opinions):  # a near-tolerance failure to any validator is a strike
        return strike(db, submitter, f"work {work_id} failed near a tolerance: {reason}")
    return [(submitter, f"work {work_id} failed verification: {reason}")]


def strike(db: CoordinatorStore, peer_id: str, reason: str) -> list[tuple[str, str]]:
    """Count one strike against `peer_id` (a borderline failure, or a unit refused at admission or
    dropped by the trainer as junk); returns [(peer_id, ban reason)] once it has `STRIKES_TO_BAN`."""
    strikes = db.add_strike(peer_id, reason[:400])
    log.warning("strike %d of %d against %s: %s", strikes, STRIKES_TO_BAN, peer_id, reason)
    if strikes < STRIKES_TO_BAN:
        return []
    return [(peer_id, f"{strikes} strikes, the last: {reason}"[:500])]
