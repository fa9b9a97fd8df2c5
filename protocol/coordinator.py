"""Coordinator state: members, policy versions, work leases, accepted rollouts, bans (durable).

Invariants:
- every work id's result is accepted at most once; an identical retry by the holder gets the same
  positive answer (idempotent), any other later submission is refused with `DuplicateSubmission`;
- a lease past its deadline, of a member that died or left, or that can no longer yield an
  admissible rollout, goes back to the pool and is granted again with the same task (and a sampling
  seed bound to its new holder, `protocol.work.holder_seed`);
- a unit is admitted only in the shape the run trains (`protocol.work.unit_group`) and only if every
  token claims a version in [oldest admissible, newest published]; a unit that fails either is
  refused (`MalformedWork`, `UnpublishedVersion`) and counted against its submitter (the service
  strikes it, `protocol.judging.strike`);
- a rollout enters a batch only within the off-policy bound (checked at submission and again
  at batch time, see `protocol.ledger`).
All methods are synchronous and called from one thread (the node's asyncio loop); `now` is
passed in so tests can drive time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

from protocol.envelope import open_envelope
from protocol.errors import (BannedPeer, DuplicateSubmission, InconsistentRollout, LeaseExpired, MalformedMessage,
                             MalformedWork, NotLeaseHolder, NotMember, Refused, ReplayedMessage, SpecMismatch,
                             StaleRollout, UnknownLease, UnpublishedVersion)
from protocol.ledger import OffPolicyLedger
from protocol.membership import FIRST_BEAT_GRACE, MembershipConfig, MembershipView
from protocol.messages import (Heartbeat, Join, JoinAccepted, LeaseGrant, PeerAddress, RolloutGroup, RolloutSubmission,
                               RunSpec, SubmissionReceipt)
from protocol.store import AcceptedRollout, CoordinatorStore, Pruned
from protocol.work import derive_work, holder_seed, unit_group

log = logging.getLogger(__name__)


RETAIN_VERSIONS = 1000
"""Policy versions of finished work the store keeps (`CoordinatorStore.prune`): a unit trained on or
dropped whose version is further behind the newest leaves the index, its segment bytes once a whole
segment is unused. 1000 steps of the sim's run (64 groups of 8) is ~0.7 GB of segments."""


PROBATION_UNITS = 16
"""An identity's work is on probation until this many of its units have entered a batch: until
then each unit it submits needs a valid verdict before it may be batched, whatever the sampled
verification rate (issue 17, item 5: bound the damage of what passes). Every unit batched while
the count is below this was verified valid, so leaving probation takes 16 valid verdicts in a row
without one proof-grade failure: a weak tamperer caught on 23% of its submissions (float32, 0.1%
of the weights' std, `benchmarks/results/weak_tamper-cpu-2core.json`) gets through with
probability 0.77^16 = 1.5%. Runs without verification (`verification_rate` 0) have no probation."""


class Coordinator:
    def __init__(self, directory: str | Path, spec: RunSpec, synchronous: str = "FULL", now: float | None = None,
                 retain_versions: int = RETAIN_VERSIONS, defer_fsync: bool = False):
        self.store = CoordinatorStore(directory, synchronous, defer_fsync)
        self.retain_versions = retain_versions
        self.probation_units = PROBATION_UNITS if spec.verification_rate > 0 else 0
        """Units of an identity that must enter a batch, each with a valid verdict, before its work
        is sampled for verification at the run's rate like everyone's (`PROBATION_UNITS`)."""
        saved = self.store.get_meta("run_spec")
        if saved is None:
            with self.store:
                self.store.set_meta("run_spec", spec.model_dump_json())
                self.store.set_meta("policy_version", "-1")
        elif RunSpec.model_validate_json(saved) != spec:
            raise SpecMismatch(f"{directory} holds another run's state ({json.loads(saved)['run_id']})")
        self.spec = spec
        self.spec_hash = spec.spec_hash()
        self.ledger = OffPolicyLedger(spec.max_off_policy_steps, int(self.store.get_meta("policy_version")))
        self.view = MembershipView(MembershipConfig(spec.heartbeat_interval_s, spec.dead_after_missed))
        # Heartbeats are not persisted: after a restart every member gets a fresh full interval.
        restart = time.time() if now is None else now
        for peer_id, role, addrs, seq in self.store.members():
            self.view.observe(peer_id, role, addrs, seq, restart)

    # ---- membership ------------------------------------------------------------------------
    def _check_fresh(self, peer_id: str, stamp_ms: int | None, what: str) -> None:
        """A Join or Leave is honoured only if signed later than the peer's last honoured one (the
        stamps are in the store, so a replay of an earlier incarnation's message fails after a
        restart too, when the in-memory replay guard is empty or the clock window has passed)."""
        last = None if stamp_ms is None else self.store.member_stamp(peer_id)
        if last is not None and stamp_ms <= last:
            raise ReplayedMessage(f"{what} from {peer_id} stamped {stamp_ms} ms is not newer than its last "
                                  f"join or leave ({last} ms)")

    def join(self, peer_id: str, msg: Join, now: float, stamp_ms: int | None = None) -> JoinAccepted:
        """`stamp_ms`: the Join envelope's signed timestamp (see `_check_fresh`)."""
        self.check_not_banned(peer_id, now)
        if msg.spec_hash != self.spec_hash:
            raise SpecMismatch(f"joiner agrees to spec {msg.spec_hash[:12]}, the run is {self.spec_hash[:12]}")
        self._check_fresh(peer_id, stamp_ms, "join")
        self.view.leave(peer_id)  # a re-join is a fresh sighting
        self.view.observe(peer_id, msg.role, msg.addrs, 0, now)
        with self.store as db:
            db.put_member(peer_id, msg.role, msg.addrs, now)
            if stamp_ms is not None:
                db.set_member_stamp(peer_id, stamp_ms)
            # A (re-)join is a fresh incarnation: whatever an earlier one held died with it (a node
            # restarted after a crash would otherwise block its work until the leases expire).
            released = db.release_leases_of(peer_id)
        if released:
            log.info("member %s re-joined; its %d earlier leases are back in the pool", peer_id, len(released))
        members = [PeerAddress(peer_id=m.peer_id, addrs=m.addrs) for m in self.view.alive(now) if m.peer_id != peer_id]
        return JoinAccepted(spec=self.spec, policy_version=self.ledger.current_version, members=members[:4096])

    def heartbeat(self, peer_id: str, msg: Heartbeat, now: float) -> None:
        if peer_id not in self.view.members:
            raise NotMember(f"heartbeat from {peer_id}, which has not joined (or was ejected)")
        self.view.observe(peer_id, msg.role, msg.addrs, msg.seq, now)
        # Heartbeats are frequent; persisting them is not needed for safety (on restart every
        # member gets a fresh full interval), so only join/leave/death touch the database.

    def leave(self, peer_id: str, now: float, stamp_ms: int | None = None) -> list[int]:
        """`stamp_ms`: the Leave envelope's signed timestamp; one older than the member's join is a
        replay of an earlier incarnation's goodbye and is refused (`ReplayedMessage`)."""
        self._check_fresh(peer_id, stamp_ms, "leave")
        self.view.leave(peer_id)
        with self.store as db:
            db.delete_member(peer_id)
            if stamp_ms is not None:
                db.set_member_stamp(peer_id, stamp_ms)
            return db.release_leases_of(peer_id)

    def sweep(self, now: float) -> tuple[list[str], list[int]]:
        """Eject dead members and return (dead peer ids, work ids put back in the pool)."""
        dead = self.view.sweep_members(now)
        interval = self.spec.heartbeat_interval_s
        with self.store as db:
            released: list[int] = []
            for m in dead:
                if m.beats == 0:  # the first beat's deadline counts from the join (MembershipView, FIRST_BEAT_GRACE)
                    log.info("member %s (%s) sent no heartbeat in the %.0f s since it joined (or since this "
                             "coordinator started), %d intervals of %.1f s allowed: dead, ejected", m.peer_id,
                             m.role, now - m.joined_at, self.spec.dead_after_missed * FIRST_BEAT_GRACE, interval)
                else:
                    log.info("member %s (%s) missed %d heartbeats (last %.0f s ago, %d beats since it joined %.0f s "
                             "ago): dead, ejected", m.peer_id, m.role, self.spec.dead_after_missed, now - m.last_seen,
                             m.beats, now - m.joined_at)
                db.delete_member(m.peer_id)
                released += db.release_leases_of(m.peer_id)
            expired = db.release_expired(now)
        return [m.peer_id for m in dead], released + expired

    # ---- policy versions ---------------------------------------------------------------------
    def advance_policy(self, version: int, manifest_hash: str, now: float) -> list[int]:
        """Record a new version; cancel leases that can no longer yield an admissible rollout."""
        self.ledger.advance(version)
        with self.store as db:
            db.add_policy_version(version, manifest_hash, now)
            stale = [w for w, leased_at in db.leases() if not self.ledger.lease_can_finish(leased_at)]
            db.release(stale)
        self.prune()
        return stale

    def prune(self) -> Pruned:
        """Apply retention: finished work more than `retain_versions` behind the newest version goes."""
        pruned = self.store.prune(self.ledger.current_version - self.retain_versions)
        if pruned.units:
            log.info("retention: %d finished work units and %d segments pruned", pruned.units, len(pruned.segments))
        return pruned

    # ---- leases ------------------------------------------------------------------------------
    def grant_lease(self, peer_id: str, now: float, ttl_s: float | None = None,
                    holds_version: int | None = None) -> LeaseGrant:
        """`ttl_s`: this lease's lifetime (default the spec's; shorter for new identities). `holds_version`:
        the newest policy the holder has loaded; the lease is recorded at the older of it and the newest
        announced (the rollout's oldest token is at best that version: the lease budget and the
        cancellation of leases that cannot finish count from it)."""
        self.check_member(peer_id, now)
        version = self.ledger.current_version
        rolls_with = version if holds_version is None else max(0, min(version, holds_version))
        deadline = now + (self.spec.lease_ttl_s if ttl_s is None else ttl_s)
        with self.store as db:
            pending = db.first_pending()
            if pending is None:
                task, seed = derive_work(self.spec.run_id, version, db.next_work_id(), self.spec.tasks_per_step)
                work_id = db.mint_work(version, task, seed, peer_id, deadline, lease_version=rolls_with)
            else:
                work_id, task, seed = pending
                db.lease(work_id, peer_id, rolls_with, deadline)
        return LeaseGrant(work_id=work_id, holder=peer_id, policy_version=version, task_index=task,
                          seed=holder_seed(seed, peer_id), deadline=deadline)

    # ---- submissions ---------------------------------------------------------------------------
    def submit(self, peer_id: str, sub: RolloutSubmission | RolloutGroup, envelope: bytes, now: float) -> SubmissionReceipt:
        """Accept a rollout exactly once; raises a `Refused` subclass with the reason otherwise.
        `envelope` is the signed wire form, stored as is."""
        result = self.submit_many([(peer_id, sub, envelope)], now)[0]
        if isinstance(result, Refused):
            raise result
        return result

    def submit_many(self, items: list[tuple[str, RolloutSubmission | RolloutGroup, bytes]], now: float
                    ) -> list[SubmissionReceipt | Refused]:
        """Group commit: check each, store the accepted ones with one fsync and one transaction."""
        results: list[SubmissionReceipt | Refused | None] = [None] * len(items)
        fresh: dict[int, tuple[int, str]] = {}  # work id -> (index in items, body hash) accepted in this batch
        for i, (peer_id, sub, _env) in enumerate(items):
            body_sha = hashlib.sha256(sub.model_dump_json().encode()).hexdigest()
            try:
                if sub.work_id in fresh:  # the same work twice in one batch: the first one wins
                    first, first_sha = fresh[sub.work_id]
                    if items[first][0] == peer_id and first_sha == body_sha:
                        results[i] = SubmissionReceipt(work_id=sub.work_id, accepted=True, duplicate=True)
                        continue
                    raise DuplicateSubmission(f"work {sub.work_id} was already accepted from {items[first][0]}")
                results[i] = self._check_submission(peer_id, sub, body_sha, now)
                if results[i] is None:
                    fresh[sub.work_id] = (i, body_sha)
            except Refused as exc:
                results[i] = exc
        order = sorted(fresh.values())
        where = self.store.append_rollouts([items[i][2] for i, _ in order])
        with self.store as db:
            for (i, body_sha), loc in zip(order, where):
                peer_id, sub, _ = items[i]
                db.insert_accepted(sub.work_id, peer_id, body_sha, sub.min_version, sub.n_tokens, sub.reward, loc, now,
                                   probation=self.on_probation(peer_id))
        for i, _ in order:
            results[i] = SubmissionReceipt(work_id=items[i][1].work_id, accepted=True)
        return results

    def _check_submission(self, peer_id: str, sub: RolloutSubmission | RolloutGroup, body_sha: str, now: float
                          ) -> SubmissionReceipt | None:
        """None: new and acceptable. A receipt: an identical retry of an accepted rollout. Raises otherwise."""
        done = self.store.accepted(sub.work_id)
        if done:
            if done[0].submitter == peer_id and done[0].body_sha256 == body_sha:
                return SubmissionReceipt(work_id=sub.work_id, accepted=True, duplicate=True)
            raise DuplicateSubmission(f"work {sub.work_id} was already accepted from {done[0].submitter}")
        self.check_not_banned(peer_id, now)
        lease = self.store.lease_of(sub.work_id)
        if lease is None:
            raise UnknownLease(f"work {sub.work_id} was never granted (or was finished long ago and pruned)")
        state, holder, deadline = lease
        if state == "pending" or (holder == peer_id and now > deadline):
            raise LeaseExpired(f"lease on work {sub.work_id} ended (deadline {deadline:.1f}, now {now:.1f}); "
                               "it was expired, cancelled as stale, or its holder was dropped")
        if holder != peer_id:
            raise NotLeaseHolder(f"work {sub.work_id} is leased to another member now")
        if sub.min_version < 0:
            raise InconsistentRollout("negative policy version")
        group = unit_group(sub, sub.work_id, self.spec.group_size)  # raises MalformedWork
        newest = max(v for r in group.rollouts for v, _ in r.version_runs)
        if newest > self.ledger.current_version:
            raise UnpublishedVersion(f"work {sub.work_id} claims policy version {newest} for some of its tokens; "
                                     f"the newest published is {self.ledger.current_version}")
        try:
            self.ledger.check_submission(sub.min_version)
        except StaleRollout:
            # the unit goes back to the pool now, not at its deadline: refused work must not hold the
            # peer's lease cap (a node whose rollouts went stale could lease nothing until its TTL ran out)
            with self.store as db:
                db.release([sub.work_id])
            raise
        return None

    EVIDENCE = (MalformedWork, UnpublishedVersion)
    """Refusals no honest node earns (a shape the run never asks for, a version nobody published):
    each is counted against the submitter (`CoordinatorService` strikes it)."""

    def on_probation(self, peer_id: str) -> bool:
        """Whether the peer's new work must be verified (and judged valid) before it may be batched."""
        return self.store.record_of(peer_id)[0] < self.probation_units

    def accepted_rollouts(self) -> list[AcceptedRollout]:
        return self.store.accepted()

    def load_rollout(self, record: AcceptedRollout) -> RolloutSubmission | RolloutGroup:
        """Read an accepted rollout (or group) back from disk, re-verifying its signature."""
        opened = open_envelope(self.store.read_rollout(record), self.spec.run_id, None, max_skew_s=float("inf"))
        if opened.signer != record.submitter or not isinstance(opened.message, (RolloutSubmission, RolloutGroup)):
            raise MalformedMessage(f"stored rollout {record.work_id} does not match its index row")
        return opened.message

    # ---- bans --------------------------------------------------------------------------------
    def ban(self, peer_id: str, reason: str, now: float, until: float | None = None) -> list[int]:
        self.view.leave(peer_id)
        with self.store as db:
            db.put_ban(peer_id, reason, until, now)
            db.delete_member(peer_id)
            return db.release_leases_of(peer_id)

    def check_not_banned(self, peer_id: str, now: float) -> None:
        ban = self.store.ban_of(peer_id)
        if ban and (ban[1] is None or ban[1] > now):
            raise BannedPeer(f"{peer_id} is banned: {ban[0]}")

    def check_member(self, peer_id: str, now: float) -> None:
        """Raise `BannedPeer` or `NotMember` unless `peer_id` is a live member in good standing."""
        self.check_not_banned(peer_id, now)
        if self.view.state(peer_id, now) == "dead":
            raise NotMember(f"{peer_id} has not joined, left, or was ejected as dead; join again")

    def close(self) -> None:
        self.store.close()
