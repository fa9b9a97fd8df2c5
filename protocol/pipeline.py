"""A work unit's path from acceptance to a trainer batch: throttled leases, verdicts, batches.

Invariants (on top of `protocol.coordinator`'s):
- a work unit enters a batch only with a valid verdict (or, at `verification_rate` < 1, when the
  selector did not pick it for verification and it is not on probation: its submitter had fewer
  than `Coordinator.probation_units` units batched when it was accepted) and within the off-policy bound;
- a work unit is in at most one batch, and asking again for step s returns the same units first
  (a trainer that lost the reply, or a coordinator restarted mid-reply, loses nothing);
- a unit's verdict is recorded once, from the validators' opinions, and a ban follows only from the
  verdict just recorded (`protocol.judging`: spot checks, seats);
- a lease is granted only while every unit out (leased, or accepted and unbatched) keeps a place
  in a batch it is admissible for (`reachable_room`: the trainer's pace and the off-policy bound
  decide how much is generated), and the pool never has more than `out_limit(k, batch)` units of
  work out, so inference nodes do not burn compute on rollouts that would only go stale, plus,
  with a `LeasePolicy`, the newcomers' budget (`newcomer_share` of it) whose leases never take room
  from identities with a record; one peer never holds more than `peer_lease_cap` (half of
  `out_limit`) leases at once;
- a unit that needs a verdict never waits for one forever (`drop_unjudged`): once validators have
  judged later units past it, or judged nothing for `JUDGE_LIMBO_S`, it is dropped as `unjudged`, so
  units in limbo hold the pool's room for at most that long.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from protocol.coordinator import Coordinator
from protocol.judging import STRIKES_TO_BAN, JudgingPolicy, record_verdicts  # noqa: F401  (the pipeline's verbs)
from protocol.messages import LeaseGrant, StoredWork
from protocol.work import holder_seed

log = logging.getLogger(__name__)

Selector = Callable[[int], bool]
"""work id -> whether a validator must judge it (the node passes an HMAC keyed selection)."""


def work_out(state: Coordinator) -> int:
    """Work units leased, or accepted and waiting for a batch (and not dropped)."""
    return (state.store.leased_count()
            + state.store.waiting_count(state.ledger.current_version - state.spec.max_off_policy_steps))


def out_limit(k: int, batch_groups: int) -> int:
    """Most work units out at once: one batch, plus half a batch per version of allowed lag. More
    would only go stale (measured: at (k + 1) batches, 15% of accepted work was dropped as stale)."""
    return batch_groups + (k * batch_groups) // 2


def open_batches(state: Coordinator) -> dict[int, int]:
    """Step -> free places in its batch, for every step a rollout generated now could still enter: from
    the one after the newest version to the last one a rollout of that version is admissible for (some
    may be full already: a trainer asks for step s + 1 while it publishes s)."""
    current, k, size = state.ledger.current_version, state.spec.max_off_policy_steps, state.spec.batch_groups
    assigned = state.store.batch_sizes(current)
    return {s: max(0, size - assigned.get(s, 0)) for s in range(current + 1, current + 2 + k)}


def first_open_step(state: Coordinator) -> int:
    """The first step whose batch still has room: a unit only admissible before it can enter no batch."""
    free = open_batches(state)
    return next((s for s, n in free.items() if n > 0), max(free) + 1)


def reachable_room(state: Coordinator, rolls_with: int) -> int:
    """How many more units a node rolling out with policy `rolls_with` may lease so that every unit out
    (leased, or accepted and waiting) still has a place in a batch it is admissible for. A unit of
    version v is admissible up to step v + 1 + k (its deadline); its place is in a batch that is not
    full yet, up to that step, earliest deadline first (as `assign_batch` and `to_verify` order them).
    The room is the least free place count over the deadlines from the new lease's to the last one:
    the trainer's pace (batches it has not taken yet) and the bound decide what is generated, so
    nothing is generated for a batch it can no longer reach (issue 28: with a fixed pool of 1.5 batches
    21% of accepted rollouts were dropped as stale)."""
    k = state.spec.max_off_policy_steps
    free = open_batches(state)
    leased, waiting = state.store.out_by_version()
    due: dict[int, int] = {}
    for version, n in [*leased.items(), *waiting.items()]:
        due[version + 1 + k] = due.get(version + 1 + k, 0) + n
    placed = places = 0
    room = None
    for step, n in free.items():
        places += n
        placed = min(places, placed + due.get(step, 0))  # units past their deadline take no place
        if step >= rolls_with + 1 + k:
            room = places - placed if room is None else min(room, places - placed)
    return 0 if room is None else room


def peer_lease_cap(k: int, batch_groups: int, alone: bool = False) -> int:
    """Most leases one peer may hold at once: half the pool, so one greedy (or Sybil-fed) peer
    asking for 1,024 units at a time cannot take all the work and starve honest nodes; the whole pool
    while it is the only live inference node (`alone`): there is nobody to starve, and half the pool
    held one GPU node to 24 groups (192 sequences) of a 32-group batch at k = 1, while its engine had
    512 slots (session 22's one-H200 network). A node that joins meanwhile gets room as the lone one's
    leases come back (it is granted nothing new while it holds more than half), or expire."""
    pool = out_limit(k, batch_groups)
    return pool if alone else max(1, (pool + 1) // 2)


@dataclass(frozen=True)
class LeasePolicy:
    """Sybil resistance for leases: identities are free, so what one may hold is earned. An
    identity's allowance grows with its work that entered a batch (verified, or not selected for
    verification) and shrinks with leases it let expire; identities with no such work ("newcomers")
    get short leases, and together hold at most `newcomer_share` of the pool, counted on top of it
    for identities with a record: hoarding identities without one never take the pool's room from
    honest nodes that have one, and N Sybils share one budget (more identities do not take more)."""

    new_allowance: int = 4
    """Leases a newcomer may hold at once (slow start)."""
    per_credit: int = 2
    """Allowance gained per work unit of the identity that entered a batch."""
    expiry_penalty: int = 2
    """Allowance lost per lease the identity let expire (never below 1)."""
    newcomer_share: float = 0.25
    """Share of the pool (`out_limit`) all newcomers together may hold, however many identities they
    are (rounded up: a pool of one lease is all newcomers' at a run's start, when nobody has a record
    yet). Identities with a record see the pool less only their own kind's work. The price: while
    hoarders fill this budget, an honest newcomer waits for one of their short leases to expire, and
    a run's first batch (when nobody has a record) is leased a quarter of the pool at a time."""
    newcomer_ttl_share: float = 0.25
    """A newcomer's lease lasts this share of `lease_ttl_s`: a hoarder's leases come back sooner."""

    def allowance(self, credited: int, expired: int, cap: int) -> int:
        return max(1, min(cap, self.new_allowance + self.per_credit * credited - self.expiry_penalty * expired))


def grant_leases(state: Coordinator, peer_id: str, count: int, now: float, peer_cap: int | None = None,
                 holds_version: int | None = None, policy: LeasePolicy | None = None) -> list[LeaseGrant]:
    """Up to `count` leases, fewer while `out_limit` units are already out or the peer already
    holds `peer_cap` (the service passes `peer_lease_cap`) or, with a `policy` (the service passes
    one), what the peer's record allows; none before version 0, and none to a
    node whose newest policy (`holds_version`) could not yield an admissible rollout (at k = 0, a
    node that has not loaded the version just announced): its work would only be refused as stale
    while the lease blocks that work. Raises `NotMember`/`BannedPeer` for a peer that may not lease."""
    state.check_member(peer_id, now)
    if state.ledger.current_version < 0:
        return []
    if holds_version is not None and not state.ledger.admissible(holds_version):
        return []
    pool = out_limit(state.spec.max_off_policy_steps, state.spec.batch_groups)
    current = state.ledger.current_version
    rolls_with = current if holds_version is None else min(current, holds_version)
    room = pool - work_out(state)
    reach = reachable_room(state, rolls_with)
    cap = pool if peer_cap is None else peer_cap
    ttl = None
    if policy is not None:
        credited, expired = state.store.record_of(peer_id)
        cap = policy.allowance(credited, expired, cap)
        newcomers = state.store.leased_by_newcomers()
        if credited == 0:
            room = min(room, math.ceil(pool * policy.newcomer_share) - newcomers)
            ttl = state.spec.lease_ttl_s * policy.newcomer_ttl_share
        else:  # what newcomers hold is never taken from identities with a record
            room += newcomers
            reach += newcomers
    room = min(room, reach)
    if peer_cap is not None or policy is not None:
        room = min(room, cap - state.store.leased_count(holder=peer_id))
    return [state.grant_lease(peer_id, now, ttl, holds_version) for _ in range(max(0, min(count, room)))]


def stored(state: Coordinator, work_ids: list[int]) -> list[StoredWork]:
    out = []
    for wid in work_ids:
        rec = state.store.accepted(wid)[0]
        task, seed = state.store.work_seed(wid)
        out.append(StoredWork(work_id=wid, task_index=task, seed=holder_seed(seed, rec.submitter),
                              envelope=state.store.read_rollout(rec)))
    return out


JUDGE_LIMBO_S = 180.0
"""How long a unit that needs a verdict may go without one while the validators skip it (they judged
units accepted after it) or judge nothing at all. Three times the validator's own deadline for a unit
it cannot judge (`node.roles.validator.UNJUDGEABLE_AFTER_S`), whose failing verdict, a strike against
the submitter, normally comes first; this one strikes nobody (the coordinator cannot tell whose fault
it was: a junk unit's, or a validator's that is down). Slow validators that judge in order are not
skipping: their backlog waits."""


def drop_unjudged(state: Coordinator, selector: Selector, now: float, limbo_s: float = JUDGE_LIMBO_S) -> list[int]:
    """Drop, as `unjudged`, units accepted more than `limbo_s` ago that need a verdict and have none,
    when validators judged a unit accepted after them or judged nothing in the last `limbo_s`."""
    old = [(w, accepted_at) for w, _, probation, accepted_at in state.store.unjudged(accepted_before=now - limbo_s)
           if probation or selector(w)]
    if not old:  # the usual case (0.1 ms, read through the waiting units' index); the progress query below
        return []  # scans the verdicts: 58-113 ms at 100,000 of them (cpu-2core, load 10-20), only while one is late
    newest_judged, last_verdict = state.store.judging_progress()
    idle = last_verdict is None or last_verdict < now - limbo_s
    late = [w for w, accepted_at in old if idle or (newest_judged or 0) > accepted_at]
    if late:
        with state.store as db:
            db.drop(late, "unjudged")
        log.warning("%d units without a verdict after %.0f s while validators %s; dropped as unjudged: %s",
                    len(late), limbo_s, "judged nothing" if idle else "judged later units", late[:16])
    return late


def to_verify(state: Coordinator, max_items: int, selector: Selector, validator: str | None = None) -> list[int]:
    """Accepted, unbatched, undropped work units without a verdict that the selector picks, or that
    are on probation (their submitter had no record, `Coordinator.probation_units`), and that still
    need an opinion from `validator` (not one it gave already: a spot check goes to another one);
    units waiting for a second opinion come first. Units that can no longer enter any batch are
    marked stale here instead (judging them is wasted work, and their policy version may already be
    gone from shardcast's retention)."""
    k = state.spec.max_off_policy_steps
    first_open = first_open_step(state)
    rows = sorted(((w, v, probation) for w, v, probation, _ in state.store.unjudged()),
                  key=lambda r: (r[1], r[0]))  # earliest deadline first
    stale = [w for w, v, _ in rows if not state.ledger.admissible(v) or v + 1 + k < first_open]
    if stale:
        with state.store as db:
            db.drop(stale, "stale")
    dropped = set(stale)
    pending = state.store.pending_opinions()
    out = [w for w, v, probation in rows if w not in dropped and (probation or selector(w) or w in pending)
           and validator not in pending.get(w, ((), 0))[0]]
    return sorted(out, key=lambda w: w not in pending)[:max_items]


def assign_batch(state: Coordinator, step: int, size: int, selector: Selector) -> list[int]:
    """The work ids of step `step`'s batch: those already assigned to it, topped up to `size` with
    verified, admissible units (stale ones and those of banned peers are marked dropped on the way)."""
    assigned = state.store.batch_of(step)
    if len(assigned) >= size:
        return assigned[:size]
    banned = state.store.banned_peers()
    with state.store as db:
        # unbatched and undropped only (never the whole history), earliest deadline (oldest version) first
        for rec, valid in sorted(db.waiting(), key=lambda rv: (rv[0].min_version, rv[0].work_id)):
            if len(assigned) >= size:
                break
            reason = ("stale" if not state.ledger.admissible(rec.min_version, step)
                      else "banned" if rec.submitter in banned else None)
            if reason:
                db.drop([rec.work_id], reason)
                continue
            if (rec.probation or selector(rec.work_id)) and not valid:
                continue  # waits for its verdict (a unit on probation always does)
            db.assign(rec.work_id, step)
            db.credit(rec.submitter)  # earned: the submitter's lease allowance grows (LeasePolicy)
            assigned.append(rec.work_id)
    return sorted(assigned)  # the same order as a repeated ask (`batch_of`: by work id)
