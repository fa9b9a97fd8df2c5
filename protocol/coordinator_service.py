"""The coordinator on the network: answers joins, lease requests and submissions; tracks heartbeats.

Binds a `Coordinator` (durable state) to a `RunNetwork` (signed messages over libp2p). Everything
inbound is verified by RunNetwork first; a refusal goes back to the peer as a typed reason. A
sweeper ejects dead members and re-grants their work; new policy versions cancel stale leases.

It runs as a process through `primerl-node coordinator launch` (node/join_cli.py, the one launcher:
run.toml -> signed spec, this service, the status page).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from protocol.coordinator import Coordinator
from protocol.envelope import Opened
from protocol.errors import NotAuthorized, NotMember, ProtocolError, UnknownWork
from protocol import judging, pipeline
from protocol.identity import NodeKey
from protocol.messages import (Ban, BatchRejects, BatchRequest, Heartbeat, Join, JoinAccepted, JoinAgain, LeaseBatchRequest, LeaseGrants,
                               Leave, Message, Ok, PolicyAnnounce, PublishPolicy,
                               RolloutGroup, RolloutSubmission, RunSpec, StoredWorkBatch, SubmissionReceipt,
                               VerdictBatch, VerifyRequest, WorkCancel, RunEnd)
from protocol.network import RunNetwork
from protocol.transport import PeerHost

log = logging.getLogger(__name__)

GUARD_FLUSH_S = 0.5
"""How often newly seen (signer, nonce) pairs are written to the store. A request seen in the last
half second before a SIGKILL may be replayed once after the restart; Join and Leave are refused even
then (their signed stamps are stored with the membership change itself)."""

MAX_GROUP = 256
"""Most submissions stored by one fsync + commit (bounds the latency of the last one in a group)."""

HOLD_S = 3.0
"""How long a request that would be answered "nothing yet" (a batch not complete, no lease room, nothing to
verify) is held, answered as soon as the pipeline moves (a submission stored, a verdict, a version, leases
back in the pool), instead of being polled for: a trainer asked for its batch every 50 ms and every ask
carried the whole partial batch's bytes (issue 28). Well under the clients' request timeouts (10 s, 30 s)."""


NOT_AWAITING_DISK = (LeaseBatchRequest, VerifyRequest, VerdictBatch)
"""Requests answered as soon as their commit is written, before it is on disk, since nothing durable can depend
on what a power cut takes back of them (the WAL is synced in order: a reply that waits for the disk, a batch or
a ban, syncs every commit before it):
- a lease that a power cut takes back is one the coordinator never granted (work ids are derived, `derive_work`,
  so a re-minted id means the same task and seed at the same version), and its holder's submission is refused as
  an unknown lease, no strike. Waiting on the disk here kept inference nodes idle behind the trainer's
  policy-version writes (session 18: lease calls up to 8.9 s on one H200 host);
- a verify request only reads (and drops stale units, which the next one drops again); a unit it offers whose
  acceptance a power cut takes back was never acknowledged, and its verdict is ignored as an unknown unit;
- a verdict a power cut takes back leaves its unit unjudged: it is offered again and judged again. A batch that
  holds the unit, and a ban the verdict caused, are told only once on disk (they wait, and sync it first).
  Waiting here held the validator behind the trainer's version writes: session 22's 5.2B run on one H200 had
  commits of 2.6-3.0 s, and a round of the claims the trainer's next batch needed started 6.5 s after the last.
Everything else a reply confirms (an accepted rollout, a batch, a join, a version) waits."""


class SyncBarrier:
    """Replies wait here until the commits they follow are on disk (`CoordinatorStore.sync`, deferred mode),
    and the event loop never does: one fsync on a worker thread serves every reply that came meanwhile, while
    the loop goes on answering (heartbeats, held requests, reads). A store that syncs inline passes at once."""

    def __init__(self, store):
        self.store = store
        self._durable = 0  # changes known to be on disk (of this connection's `total_changes`)
        self._running: asyncio.Future | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="coordinator-fsync") if store.deferred else None

    async def wait(self) -> None:
        """Return once every change committed before the call is durable; raises what a failed fsync raised."""
        if self._thread is None:
            return
        target = self.store.changes
        while self._durable < target:
            if self._running is None:
                self._running = asyncio.ensure_future(self._sync())
            await asyncio.shield(self._running)

    async def _sync(self) -> None:
        upto = self.store.changes  # read on the loop: everything committed so far is in the files synced next
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._thread, self.store.sync)
            self._durable = max(self._durable, upto)
        finally:
            self._running = None
        try:  # after the replies, on the same thread: none waits for it
            loop.run_in_executor(self._thread, self._checkpoint)
        except RuntimeError:  # the service is stopping (the pool is shut): the store's close syncs
            pass

    def _checkpoint(self) -> None:
        try:
            self.store.checkpoint()
        except Exception:  # the WAL stays; the next sync tries again
            log.exception("checkpointing the coordinator's WAL failed")

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)


class CoordinatorService:
    def __init__(self, key: NodeKey, coordinator: Coordinator, host: PeerHost,
                 selector: pipeline.Selector = lambda work_id: True):
        if coordinator.spec.coordinator != key.peer_id:
            raise ValueError("the run spec names another coordinator key")
        self.key = key
        self.state = coordinator
        self.host = host
        self.net = RunNetwork(host, key, coordinator.spec.run_id)
        self._tasks: list[asyncio.Task] = []
        self._seq = 0
        self._pending: list[tuple[Opened, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self.hold_s = min(HOLD_S, coordinator.spec.heartbeat_interval_s)
        """How long an empty answer is held (`HOLD_S`, at most a heartbeat interval: a member waiting on
        its answer is touched as alive when it comes; 0: answered at once)."""
        self._moved = asyncio.Event()
        """Set (and replaced) whenever the pipeline moves: held requests look again (`_hold`)."""
        self._refused_beats: dict[str, float] = {}
        """Peer -> when its last refused heartbeat was logged and answered (`_tell_to_join_again`)."""
        self.selector = selector
        """work id -> whether it needs a validator's verdict before it may enter a batch."""
        self.on_verdicts: list = []
        """Callbacks (validator, verdicts) for observers such as the status page."""
        self.lease_policy: pipeline.LeasePolicy | None = pipeline.LeasePolicy()
        """What an identity may hold, by its record (None: only the per-peer cap, as before)."""
        self.judging = pipeline.JudgingPolicy()
        """How often validators are spot-checked by one another (`protocol.judging`)."""
        self.limbo_s = pipeline.JUDGE_LIMBO_S
        """How long a unit may wait for a verdict while validators skip it (`pipeline.drop_unjudged`)."""
        self.ended = asyncio.Event()
        """Set a grace period after the trainer reported the run's last step, or once every member has left
        after it, whichever comes first (the launcher then exits 0)."""
        self._everyone_left = asyncio.Event()
        """Set when the run has ended and no member is left in the view (`_note_departures`)."""
        self.durable = SyncBarrier(coordinator.store)
        """Every reply waits for the commits before it to reach the disk, off the event loop."""

    @property
    def spec(self) -> RunSpec:
        return self.state.spec

    async def start(self) -> None:
        # The replay guard survives restarts: pairs seen within its horizon are read back, and new
        # ones written behind every GUARD_FLUSH_S (`_persist_guard`), before any request or gossip is served.
        guard = self.net.guard
        guard.durable = True
        guard.preload(self.state.store.seen_since(time.time() - guard.horizon_s), time.time())
        self._tasks.append(asyncio.create_task(self._persist_guard(), name="coordinator-replay-guard"))
        self.net.serve(Join, self._once_durable(self._on_join))
        for message, handler in ((RolloutSubmission, self._on_submission), (RolloutGroup, self._on_submission),
                                 (LeaseBatchRequest, self._on_lease_batch), (BatchRequest, self._on_batch_request),
                                 (VerifyRequest, self._on_verify_request), (VerdictBatch, self._on_verdicts),
                                 (PublishPolicy, self._on_publish), (RunEnd, self._on_run_end),
                                 (BatchRejects, self._on_batch_rejects)):
            served = self._member_alive(handler)
            self.net.serve(message, served if message in NOT_AWAITING_DISK else self._once_durable(served))
        self.net.on_gossip(self._on_gossip)
        await self.net.start_gossip()
        self._tasks.append(asyncio.create_task(self._sweeper(), name="coordinator-sweeper"))
        self._tasks.append(asyncio.create_task(self._committer(), name="coordinator-committer"))
        self._tasks.append(asyncio.create_task(self._beat(), name="coordinator-heartbeat"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.net.close()
        self._flush_guard()
        self.durable.close()

    def _once_durable(self, handler):
        """A reply goes out only once what its request (and any before it) committed is on disk."""
        async def serve(o: Opened):
            reply = await handler(o)
            await self.durable.wait()
            return reply
        return serve

    def _member_alive(self, handler):
        """A member's request keeps it alive like a heartbeat does (MembershipView.touch). A request from a
        peer that is not a member (ejected as dead, or unknown to this coordinator) is refused with
        `NotMember`: its client joins again and retries, so a live member never stays out of the view."""
        async def serve(o: Opened):
            if o.signer != self.key.peer_id and o.signer not in self.state.view.members:
                self.state.check_not_banned(o.signer, time.time())  # a banned peer is told so, not to rejoin
                raise NotMember(f"{o.signer} is not a member (ejected as dead, or never joined); join again")
            self.state.view.touch(o.signer, time.time())
            reply = await handler(o)
            self.state.view.touch(o.signer, time.time())  # it waited on a held answer (`_hold`): alive all along
            return reply
        return serve

    def _flush_guard(self) -> None:
        now = time.time()
        self.state.store.remember_seen(self.net.guard.drain(), now - self.net.guard.horizon_s)

    async def _persist_guard(self) -> None:
        while True:
            await asyncio.sleep(GUARD_FLUSH_S)
            try:
                self._flush_guard()
            except Exception:
                log.exception("persisting the replay guard failed")

    def _pipeline_moved(self) -> None:
        self._moved.set()
        self._moved = asyncio.Event()

    async def _hold(self, answer, ready):
        """`answer()` once `ready(it)`, or after `hold_s`; looked at again each time the pipeline moves."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.hold_s
        while True:
            moved = self._moved
            result = answer()
            left = end - loop.time()
            if ready(result) or left <= 0:
                return result
            try:
                await asyncio.wait_for(moved.wait(), left)
            except asyncio.TimeoutError:
                pass

    # ---- requests ------------------------------------------------------------------------------
    async def _on_join(self, o: Opened) -> JoinAccepted:
        reply = self.state.join(o.signer, o.message, time.time(), stamp_ms=o.timestamp_ms)
        log.info("member %s joined as %s", o.signer, o.message.role)
        return reply

    async def _on_lease_batch(self, o: Opened) -> LeaseGrants:
        alone = not any(m.role == "inference" and m.peer_id != o.signer for m in self.state.view.alive(time.time()))
        cap = pipeline.peer_lease_cap(self.state.spec.max_off_policy_steps, self.state.spec.batch_groups, alone)
        holds = o.message.policy_version

        def ready(granted: list) -> bool:
            # A node behind the newest version is fetching it and asks again once it holds it: its request,
            # made for the older one, is answered at once, not held for room only the newer one can take
            # (held, it kept a node that had just loaded a version idle for the rest of the hold, 1-3 s).
            behind = holds is not None and holds < self.state.ledger.current_version
            return bool(granted) or o.message.count == 0 or behind

        grants = await self._hold(
            lambda: pipeline.grant_leases(self.state, o.signer, o.message.count, time.time(), cap,
                                          policy=self.lease_policy, holds_version=holds), ready)
        return LeaseGrants(grants=grants)

    def _require(self, peer_id: str, role: str, allowed: list[str]) -> None:
        """Only the spec's named peers (or, if it names none, members of `role`) may do this."""
        member = self.state.view.members.get(peer_id)
        ok = peer_id in allowed if allowed else (member is not None and member.role == role)
        if not ok:
            raise (NotMember if member is None and not allowed else NotAuthorized)(
                f"{peer_id} may not act as {role} in this run")

    def _require_validator(self, peer_id: str) -> None:
        """Only the validators the signed spec names, or the coordinator's own key, may pull work to
        verify or judge it; with none named, no member can (joining as "validator" grants nothing)."""
        if peer_id != self.key.peer_id and peer_id not in self.spec.validators:
            raise NotAuthorized(f"{peer_id} is not a validator of this run (the spec names "
                                f"{len(self.spec.validators)})")
        lost = self.state.store.unseated().get(peer_id)
        if lost is not None:
            raise NotAuthorized(f"{peer_id} lost its validator seat: {lost}")

    async def _on_batch_request(self, o: Opened) -> StoredWorkBatch:
        self._require(o.signer, "trainer", [self.spec.trainer] if self.spec.trainer else [])
        step, groups = o.message.step, o.message.groups
        ids = await self._hold(lambda: pipeline.assign_batch(self.state, step, groups, self.selector),
                               lambda assigned: len(assigned) >= groups)
        # an incomplete batch goes back without its units' bytes: the trainer asks again for all of it
        return StoredWorkBatch(step=step, items=pipeline.stored(self.state, ids) if len(ids) >= groups else [])

    async def _on_batch_rejects(self, o: Opened) -> Ok:
        """The trainer could not train on these units of its batch: out of the batch for good (a restarted
        trainer never gets them again), dropped, and a strike against each submitter."""
        self._require(o.signer, "trainer", [self.spec.trainer] if self.spec.trainer else [])
        offenders: list[tuple[str, str]] = []
        with self.state.store as db:
            for failure in o.message.failures:
                rec = db.accepted(failure.work_id)
                if not rec or not db.unbatch([failure.work_id], o.message.step, "rejected_by_trainer"):
                    if rec and rec[0].dropped == "rejected_by_trainer":
                        continue  # a retry of a report already taken
                    raise UnknownWork(f"work {failure.work_id} is not in the batch of step {o.message.step}")
                log.warning("trainer rejected work %d of step %d from %s: %s", failure.work_id, o.message.step,
                            rec[0].submitter, failure.reason)
                offenders += judging.strike(db, rec[0].submitter, f"work {failure.work_id} rejected by the "
                                            f"trainer: {failure.reason}")
        await self._ban_all(offenders)
        return Ok()

    async def _ban_all(self, offenders: list[tuple[str, str]]) -> None:
        for peer_id, reason in dict(offenders).items():
            log.warning("banning %s: %s", peer_id, reason)
            await self.ban(peer_id, reason)

    async def _on_verify_request(self, o: Opened) -> StoredWorkBatch:
        self._require_validator(o.signer)
        ids = await self._hold(lambda: pipeline.to_verify(self.state, o.message.max_items, self.selector, o.signer),
                               bool)
        return StoredWorkBatch(items=pipeline.stored(self.state, ids))

    async def _on_verdicts(self, o: Opened) -> Ok:
        self._require_validator(o.signer)
        offenders = pipeline.record_verdicts(self.state, o.signer, o.message.verdicts, time.time(), self.judging)
        self._pipeline_moved()
        for cb in self.on_verdicts:
            cb(o.signer, o.message.verdicts)
        await self._ban_all(offenders)
        return Ok()

    async def _on_run_end(self, o: Opened) -> Ok:
        """The trainer's last step is done: record it, tell everyone (again with every heartbeat), and
        set `ended` once members have had `dead_after_missed` heartbeat intervals to hear it, or sooner
        once every member has left (each heard it: nobody is left to tell)."""
        self._require(o.signer, "trainer", [self.spec.trainer] if self.spec.trainer else [])
        if self.state.store.get_meta("ended_at_step") is None:
            with self.state.store as db:
                db.set_meta("ended_at_step", str(o.message.step))
            log.info("run ended at trainer step %d; announcing it", o.message.step)
            await self.gossip(RunEnd(step=o.message.step))

            async def close_after_grace() -> None:
                self._note_departures()
                try:
                    await asyncio.wait_for(self._everyone_left.wait(),
                                           self.spec.heartbeat_interval_s * self.spec.dead_after_missed)
                except TimeoutError:  # a member that neither left nor died yet: its grace is over
                    pass
                self.ended.set()
            self._tasks.append(asyncio.create_task(close_after_grace(), name="coordinator-end"))
        return Ok()

    async def _on_publish(self, o: Opened) -> Ok:
        self._require(o.signer, "trainer", [self.spec.trainer] if self.spec.trainer else [])
        msg = o.message
        if msg.version > self.state.ledger.current_version:
            stale = await self.announce_policy(msg.version, msg.manifest_hash)
            log.info("policy version %d announced (%d stale leases cancelled)", msg.version, len(stale))
        else:  # a retry after a lost reply, or a restarted trainer: re-announce so nobody misses it
            await self.gossip(PolicyAnnounce(version=msg.version, manifest_hash=msg.manifest_hash))
        return Ok()

    async def _on_submission(self, o: Opened) -> SubmissionReceipt:
        # Group commit: queue, and let one committer store everything queued with one fsync.
        # While it blocks the loop on that fsync, new submissions pile up in the libp2p thread
        # and form the next group, so the group size follows the load by itself.
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((o, fut))
        self._wake.set()
        return await fut

    async def _committer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending[:MAX_GROUP], self._pending[MAX_GROUP:]
            if self._pending:
                self._wake.set()
            try:
                results = self.state.submit_many([(o.signer, o.message, o.raw) for o, _ in batch], time.time())
            except Exception as exc:  # e.g. disk full: nobody in this group is acknowledged
                log.exception("storing %d submissions failed", len(batch))
                results = [exc] * len(batch)
            self._pipeline_moved()
            for (_, fut), result in zip(batch, results):
                if not fut.done():
                    fut.set_exception(result) if isinstance(result, Exception) else fut.set_result(result)
            await self._strike_junk([(o.signer, r) for (o, _), r in zip(batch, results)])

    async def _strike_junk(self, results: list[tuple[str, object]]) -> None:
        """Refusals no honest node earns (`Coordinator.EVIDENCE`) count against their submitter."""
        junk = [(peer, r) for peer, r in results if isinstance(r, self.state.EVIDENCE)]
        if not junk:
            return
        try:
            with self.state.store as db:
                offenders = [o for peer, r in junk for o in judging.strike(db, peer, f"{r.reason}: {r}")]
            await self._ban_all(offenders)
        except Exception:
            log.exception("striking %d refused submissions failed", len(junk))

    # ---- gossip --------------------------------------------------------------------------------
    async def _on_gossip(self, o: Opened) -> None:
        msg = o.message
        if isinstance(msg, Heartbeat):
            try:
                self.state.heartbeat(o.signer, msg, time.time())
            except NotMember as exc:
                await self._tell_to_join_again(o.signer, msg, exc)
        elif isinstance(msg, Leave):
            released = self.state.leave(o.signer, time.time(), stamp_ms=o.timestamp_ms)
            self._pipeline_moved()
            log.info("member %s left (%s); %d leases back in the pool", o.signer, msg.reason, len(released))
            self._note_departures()

    def _note_departures(self) -> None:
        """After the run's end, the last member leaving (or ejected dead) ends the coordinator's grace."""
        if not self.state.view.members and self.state.store.get_meta("ended_at_step") is not None:
            self._everyone_left.set()

    async def _tell_to_join_again(self, peer_id: str, beat: Heartbeat, exc: NotMember) -> None:
        """A heartbeat from a non-member: gossip a signed `JoinAgain` naming it (the member joins again), and
        log it, each at most once per peer per heartbeat interval (not once per heartbeat)."""
        now = time.monotonic()
        if now - self._refused_beats.get(peer_id, float("-inf")) < self.spec.heartbeat_interval_s:
            return
        self._refused_beats[peer_id] = now
        if len(self._refused_beats) > 4096:  # bounded: forget the oldest
            for p in sorted(self._refused_beats, key=self._refused_beats.get)[:1024]:
                del self._refused_beats[p]
        ban = self.state.store.ban_of(peer_id)
        if ban and (ban[1] is None or ban[1] > time.time()):  # a banned peer is not asked back
            log.info("heartbeat %d from %s (%s) refused: banned (%s)", beat.seq, peer_id, beat.role, ban[0])
            return
        log.info("heartbeat %d from %s (%s) refused: %s; told to join again", beat.seq, peer_id, beat.role, exc)
        try:
            await self.gossip(JoinAgain(peer_id=peer_id, heartbeat_seq=beat.seq, reason=str(exc)[:500]))
        except ProtocolError as send_exc:
            log.warning("join-again notice to %s not sent: %s", peer_id, send_exc)

    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.spec.heartbeat_interval_s / 2)
            try:
                dead, released = self.state.sweep(time.time())
                if dead or released:
                    self._pipeline_moved()
                    log.info("sweep: dead %s; work back in the pool %s", dead, released)
                    self._note_departures()
                pipeline.drop_unjudged(self.state, self.selector, time.time(), self.limbo_s)
            except Exception:
                log.exception("sweep failed")

    async def _beat(self) -> None:
        while True:
            self._seq += 1
            try:
                await self.net.gossip(Heartbeat(seq=self._seq, role="coordinator", addrs=self.host.addrs[:16]))
                ended = self.state.store.get_meta("ended_at_step")
                if ended is not None:  # late joiners and members that missed it hear it too
                    await self.net.gossip(RunEnd(step=int(ended)))
            except ProtocolError as exc:
                log.warning("coordinator heartbeat not sent: %s", exc)
            await asyncio.sleep(self.spec.heartbeat_interval_s)

    # ---- announcements -------------------------------------------------------------------------
    async def announce_policy(self, version: int, manifest_hash: str) -> list[int]:
        """Record and gossip a new policy version; cancel (and gossip) leases now too stale."""
        stale = self.state.advance_policy(version, manifest_hash, time.time())
        self._pipeline_moved()
        await self.durable.wait()
        await self.gossip(PolicyAnnounce(version=version, manifest_hash=manifest_hash))
        if stale:
            await self.gossip(WorkCancel(work_ids=stale, policy_version=version))
        return stale

    async def ban(self, peer_id: str, reason: str, until: float | None = None) -> None:
        self.state.ban(peer_id, reason, time.time(), until)
        self._pipeline_moved()
        await self.durable.wait()  # a ban told to the network is one the coordinator still knows after a crash
        await self.gossip(Ban(peer_id=peer_id, reason=reason, until=until))

    async def gossip(self, message: Message) -> None:
        await self.net.gossip(message)
