"""The one way a member talks to its coordinator: a typed client whose methods name the operations.

Invariants:
- every reply is checked against the type the operation expects; anything else is an
  `UnexpectedReply` (a typed error, never an attribute error three calls later);
- accepted work units reach the caller opened (`protocol.work.open_unit`): an `AcceptedGroup` whose
  signature and shape were re-checked, or an `UnreadableUnit` with its typed error, never raw bytes;
- a coordinator that is briefly gone (restart, churn, a slow link) only delays a caller: transport
  errors are retried with backoff, and a `NotMember` answer (the coordinator restarted without our
  membership, or swept us as dead) leads to a fresh join and a retry;
- every other refusal (`StaleRollout`, `LeaseExpired`, `BannedPeer`, ...) is an answer, raised to the
  caller at once: it decides what to do;
- with `stop` set, a waiting call ends with `asyncio.CancelledError` (a clean shutdown).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TypeVar

from protocol.errors import BannedPeer, NotMember, ProtocolError, Refused, TransportError, UnexpectedReply
from protocol.identity import NodeKey
from protocol.member import EXIT_BANNED, RunMember
from protocol.messages import (BatchRejects, BatchRequest, LeaseBatchRequest, LeaseGrant, LeaseGrants, Message, Ok, PublishPolicy,
                               Role, RolloutGroup, RolloutSubmission, RunSpec, StoredWork, StoredWorkBatch,
                               RunEnd, SubmissionReceipt, UnitFailure, Verdict, VerdictBatch, VerifyRequest)
from protocol.transport import PeerHost
from protocol.work import OpenedUnit, open_unit

log = logging.getLogger(__name__)
R = TypeVar("R", bound=Message)


@dataclass(frozen=True)
class Retry:
    """How long a call keeps trying through outages."""

    tries: int = 1_000_000
    """Attempts before the last error is raised (1: no retry, no re-join)."""
    first_delay_s: float = 0.3
    """Wait after the first failed attempt; doubles after each one."""
    max_delay_s: float = 3.0
    """Longest wait between two attempts."""


class RunStop(asyncio.Event):
    """The event a role's loops stop on, and why: a signal or the run's end (exit code 0), or a ban
    (`EXIT_BANNED`). `primerl-node join` exits with `exit_code`, printing `why`."""

    def __init__(self) -> None:
        super().__init__()
        self.exit_code = 0
        self.why = ""

    def end(self, exit_code: int, why: str) -> None:
        if not self.is_set():
            self.exit_code, self.why = exit_code, why
            log.warning("stopping: %s", why) if exit_code else log.info("stopping: %s", why)
        self.set()


def _end(stop: asyncio.Event, code: int, why: str) -> None:
    (stop.end(code, why) if isinstance(stop, RunStop) else stop.set())


ONCE = Retry(tries=1)
"""One attempt: errors, `NotMember` included, go straight to the caller (tests, benchmarks)."""

BULK_TIMEOUT_S = 30.0
"""Timeout of the requests whose replies carry stored rollouts (a batch, work to verify, verdicts)."""


@dataclass(frozen=True)
class MemberStatus:
    """What this member knows of the run (from its join reply and the coordinator's gossip)."""

    policy_version: int
    """Newest policy version announced (-1: none yet)."""
    alive_peers: frozenset[str]
    """Members whose heartbeats arrive."""
    banned: dict[str, str]
    """Banned peer -> reason, as the coordinator announced."""


class CoordinatorClient:
    """Lease, submit, batch, to-verify, verdicts, publish and status, over one `RunMember`.

    `bootstrap`: the coordinator's multiaddr, for re-joins (None: a `NotMember` is raised)."""

    def __init__(self, member: RunMember, bootstrap: str | None = None, stop: asyncio.Event | None = None,
                 retry: Retry = Retry()):
        self.member = member
        self.bootstrap = bootstrap
        self.stop = stop or asyncio.Event()
        self.retry = retry
        # the coordinator ending the run, or banning us, stops the role (a banned node must not retry forever)
        member.on_end.append(lambda code, why: _end(self.stop, code, why))

    @classmethod
    async def connect(cls, key: NodeKey, spec: RunSpec, role: Role, bootstrap: str, stop: asyncio.Event,
                      listen: str = "/ip4/127.0.0.1/tcp/0", retry: Retry = Retry()) -> "CoordinatorClient":
        """Start a libp2p host and join, retrying with backoff until the coordinator answers (or stop is set)."""
        host = PeerHost(key, listen)
        await host.start()
        member = RunMember(key, host, spec, role)
        delay = retry.first_delay_s
        while not stop.is_set():
            try:
                await member.join(bootstrap)
                log.info("%s %s joined run %s (policy version %d)", role, key.peer_id[-8:], spec.run_id,
                         member.policy_version)
                return cls(member, bootstrap, stop, retry)
            except BannedPeer as exc:
                _end(stop, EXIT_BANNED, f"banned: {exc}")
                await host.stop()
                raise
            except ProtocolError as exc:
                log.warning("join failed (%s: %s); retrying in %.1fs", type(exc).__name__, exc, delay)
                await _sleep_or_stop(stop, delay)
                delay = min(delay * 2, max(retry.max_delay_s, 5.0))
        await host.stop()
        raise asyncio.CancelledError("stopped before joining")

    # ---- operations --------------------------------------------------------------------------
    async def lease(self, count: int, holds_version: int | None = None) -> list[LeaseGrant]:
        """Up to `count` work units (possibly none: enough work is out, or no policy yet; ask again).
        `holds_version`: the newest policy this node can roll out with (default: the newest announced)."""
        held = self.member.policy_version if holds_version is None else holds_version
        reply = await self._call(LeaseBatchRequest(policy_version=held, count=count), LeaseGrants, "lease")
        return list(reply.grants)

    async def submit(self, work: RolloutGroup | RolloutSubmission) -> SubmissionReceipt:
        """Store a result; raises the coordinator's typed refusal (`StaleRollout`, `LeaseExpired`, ...)."""
        return await self._call(work, SubmissionReceipt, f"submit work {work.work_id}")

    async def batch(self, step: int, groups: int) -> list[OpenedUnit]:
        """The work units assigned to trainer step `step`, opened (`protocol.work.open_unit`): at most
        `groups`, none while verified work is still short (idempotent: asking again gets the same)."""
        reply = await self._call(BatchRequest(step=step, groups=groups), StoredWorkBatch, f"batch {step}",
                                 BULK_TIMEOUT_S)
        return self._opened(reply.items[:groups])

    async def reject_units(self, step: int, failures: list[UnitFailure]) -> None:
        """Trainer: these units of step `step`'s batch cannot be trained on; the coordinator takes them out
        of the batch for good (asking again tops it up) and strikes their submitters."""
        await self._call(BatchRejects(step=step, failures=failures), Ok, f"reject units of batch {step}")

    async def to_verify(self, max_items: int) -> list[OpenedUnit]:
        """Accepted work units that still need this validator's verdict, opened (`protocol.work.open_unit`)."""
        reply = await self._call(VerifyRequest(max_items=max_items), StoredWorkBatch, "verify request", BULK_TIMEOUT_S)
        return self._opened(reply.items)

    def _opened(self, items: list[StoredWork]) -> list[OpenedUnit]:
        spec = self.member.spec
        return [open_unit(item, spec.run_id, spec.group_size) for item in items]

    async def verdicts(self, verdicts: list[Verdict]) -> None:
        """Report verdicts (a failing one bans its submitter)."""
        await self._call(VerdictBatch(verdicts=verdicts), Ok, "verdicts", BULK_TIMEOUT_S)

    async def announce(self, version: int, manifest_hash: str) -> None:
        """Have the coordinator announce policy `version` (idempotent: a retry re-announces)."""
        await self._call(PublishPolicy(version=version, manifest_hash=manifest_hash), Ok, f"announce v{version}")

    async def end_run(self, step: int) -> None:
        """Trainer: the last step is done; the coordinator announces the end to every member."""
        await self._call(RunEnd(step=step), Ok, "end of run")

    def status(self) -> MemberStatus:
        return MemberStatus(self.member.policy_version, frozenset(self.member.alive_peers()), dict(self.member.banned))

    # ---- what the coordinator gossips ----------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self.member.policy_version

    def on_policy(self, callback) -> None:
        """Call `await callback(PolicyAnnounce)` for every version the coordinator announces."""
        self.member.on_policy.append(callback)

    def lease_cancelled(self, grant: LeaseGrant) -> bool:
        """Whether the coordinator cancelled this lease as too stale to finish."""
        return self.member.lease_cancelled(grant)

    async def close(self, reason: str = "shutting down") -> None:
        """Leave the run (our leases go back to the pool at once) and stop the host."""
        await self.member.leave(reason)
        await self.member.host.stop()

    # ---- the one request path ------------------------------------------------------------------
    async def _call(self, message: Message, expect: type[R], what: str, timeout: float | None = None) -> R:
        delay = self.retry.first_delay_s
        for attempt in range(1, self.retry.tries + 1):
            last = attempt == self.retry.tries
            joins = self.member.rejoins
            try:
                reply = await self.member.net.request(self.member.coordinator, message,
                                                      timeout or self.member.request_timeout)
                if not isinstance(reply, expect):
                    raise UnexpectedReply(f"{what}: expected {expect.__name__}, got {type(reply).__name__}")
                return reply
            except BannedPeer as exc:
                _end(self.stop, EXIT_BANNED, f"banned: {exc}")
                raise
            except NotMember:
                if last or self.bootstrap is None:
                    raise
                if self.member.rejoins == joins:  # else a concurrent call (or a JoinAgain) joined meanwhile
                    log.info("%s: not a member (coordinator restarted or ejected us); joining again", what)
                    try:
                        await self.member.join(self.bootstrap)
                    except ProtocolError as exc:
                        log.warning("re-join failed: %s", exc)
            except Refused as exc:
                if exc.reason != "InternalError" or last:
                    raise
                # the coordinator's handler failed (a bug, or a coordinator shutting down): not ours to die of
                log.warning("%s: the coordinator could not answer (%s); retrying in %.1fs", what, exc, delay)
            except TransportError as exc:
                if last:
                    raise
                log.info("%s: %s; retrying in %.1fs", what, exc, delay)
                if self.bootstrap is not None:  # the coordinator may have restarted: dial it afresh
                    try:
                        await self.member.host.connect(self.bootstrap, timeout=min(5.0, self.member.request_timeout))
                    except ProtocolError as dial_exc:
                        log.debug("re-dial of %s failed: %s", self.bootstrap, dial_exc)
            if self.stop.is_set():
                raise asyncio.CancelledError(f"stopped during {what}")
            await _sleep_or_stop(self.stop, delay)
            delay = min(delay * 2, self.retry.max_delay_s)
        raise AssertionError("unreachable")


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        pass

