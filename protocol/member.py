"""A run member (inference, trainer, validator, relay): join, heartbeat, discover peers, follow the
coordinator's announcements, leave. Requests to the coordinator go through `protocol.client`.

Bootstrap is one multiaddr (the coordinator's); the join reply lists live members and every
heartbeat carries its sender's addresses, so a member dials peers it learns of through the network
(up to `max_peers`) and its view of the membership converges through gossip after churn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from protocol.envelope import Opened
from protocol.errors import ProtocolError, UnexpectedReply
from protocol.identity import NodeKey
from protocol.membership import MembershipConfig, MembershipView
from protocol.messages import (Ban, Heartbeat, Join, JoinAccepted, JoinAgain, LeaseGrant, Leave, PolicyAnnounce, Role,
                               RunEnd, RunSpec, WorkCancel)
from protocol.network import RunNetwork
from protocol.transport import PeerHost

log = logging.getLogger(__name__)

EXIT_BANNED = 3
"""Exit code of a member the coordinator banned (`primerl-node join` exits with it, saying why)."""


class RunMember:
    def __init__(self, key: NodeKey, host: PeerHost, spec: RunSpec, role: Role, max_peers: int = 32,
                 request_timeout: float = 10.0):
        self.key = key
        self.host = host
        self.spec = spec
        self.role = role
        self.max_peers = max_peers
        self.request_timeout = request_timeout
        self.net = RunNetwork(host, key, spec.run_id)
        self.view = MembershipView(MembershipConfig(spec.heartbeat_interval_s, spec.dead_after_missed))
        self.policy_version = -1
        self.cancelled: set[int] = set()
        """Work ids the coordinator cancelled as too stale to finish (stop working on them)."""
        self.cancelled_at: dict[int, int] = {}
        """Work id -> policy version whose arrival cancelled it. Cancelled work goes back to the pool
        under the same id; a lease granted at that version or later is a new one (`lease_cancelled`)."""
        self.banned: dict[str, str] = {}
        self.on_policy: list[Callable[[PolicyAnnounce], Awaitable[None]]] = []
        self.on_end: list[Callable[[int, str], None]] = []
        """Called with (exit code, why) when the coordinator ends the run (0) or bans this member."""
        self._seq = 0
        self._tasks: list[asyncio.Task] = []
        self._dialing: set[str] = set()
        self._beating: asyncio.Task | None = None
        self._listening = False
        self._bootstrap: str | None = None
        self._joining = asyncio.Lock()  # one join at a time: a second would release the leases the first got
        self._joined_after_seq = -1
        """Our heartbeat seq when our last join was sent: a `JoinAgain` about a beat up to it is about an
        earlier incarnation of our membership, and is ignored."""
        self.rejoins = 0
        """Join attempts after the first (told by the coordinator, a `NotMember` answer to a request, or a
        first join retried)."""

    @property
    def coordinator(self) -> str:
        return self.spec.coordinator

    async def join(self, bootstrap: str) -> JoinAccepted:
        """Dial the bootstrap multiaddr, join the run, dial the members it lists, start beating."""
        async with self._joining:
            return await self._join(bootstrap)

    async def _join(self, bootstrap: str) -> JoinAccepted:
        if self._bootstrap is not None:
            self.rejoins += 1
        self._bootstrap = bootstrap
        await self.host.connect(bootstrap)
        if not self._listening:  # a re-join (after a coordinator restart) must not double the handlers
            self.net.on_gossip(self._on_gossip)
            self._listening = True
        await self.net.start_gossip()
        self._joined_after_seq = self._seq
        reply = await self.net.request(self.coordinator, Join(spec_hash=self.spec.spec_hash(), role=self.role,
                                                              addrs=self._addrs()), self.request_timeout)
        _expect(reply, JoinAccepted)
        if reply.spec != self.spec:
            raise ProtocolError("coordinator answered with another run spec")
        self.policy_version = max(self.policy_version, reply.policy_version)
        now = time.time()
        for m in reply.members:
            self.view.observe(m.peer_id, "?", m.addrs, -1, now)
            self._discover(m.peer_id, m.addrs)
        if self._beating is None or self._beating.done():
            self._beating = asyncio.create_task(self._beat(), name=f"heartbeat-{self.key.peer_id[-6:]}")
            self._tasks.append(self._beating)
        return reply

    async def leave(self, reason: str = "shutting down") -> None:
        """Graceful leave: the coordinator returns our leases to the pool at once."""
        await self._stop_tasks()
        try:
            await self.net.gossip(Leave(reason=reason))
        except ProtocolError as exc:
            log.warning("leave not announced: %s", exc)
        await self.net.close()

    async def crash(self) -> None:
        """Stop without a word (tests: a member that dies)."""
        await self._stop_tasks()
        await self.net.close()

    def lease_cancelled(self, grant: LeaseGrant) -> bool:
        """Whether this lease was cancelled. Gossip may bring the cancel of an earlier lease on the
        same work id after a re-grant arrived by request, so the versions decide, not the order."""
        return self.cancelled_at.get(grant.work_id, -1) > grant.policy_version

    def alive_peers(self) -> set[str]:
        return {m.peer_id for m in self.view.alive(time.time())}

    # ---- internals -----------------------------------------------------------------------------
    def _addrs(self) -> list[str]:
        return [a.split("/p2p/")[0] for a in self.host.addrs][:16]

    async def _beat(self) -> None:
        while True:
            self._seq += 1
            try:
                await self.net.gossip(Heartbeat(seq=self._seq, role=self.role, addrs=self._addrs()))
            except ProtocolError as exc:
                log.warning("heartbeat not sent: %s", exc)
            dead = self.view.sweep(time.time())
            if dead:
                log.info("peers dead in our view: %s", dead)
            await asyncio.sleep(self.spec.heartbeat_interval_s)

    async def _on_gossip(self, o: Opened) -> None:
        msg, now = o.message, time.time()
        if isinstance(msg, Heartbeat):
            if self.view.observe(o.signer, msg.role, msg.addrs, msg.seq, now):
                self._discover(o.signer, msg.addrs)
        elif isinstance(msg, Leave):
            self.view.leave(o.signer)
        elif o.signer != self.coordinator:
            log.info("ignoring %s from %s: only the coordinator announces it", msg.type, o.signer)
        elif isinstance(msg, PolicyAnnounce):
            self.policy_version = max(self.policy_version, msg.version)
            for cb in self.on_policy:
                await cb(msg)
        elif isinstance(msg, WorkCancel):
            self.cancelled.update(msg.work_ids)
            for w in msg.work_ids:
                self.cancelled_at[w] = max(self.cancelled_at.get(w, -1), msg.policy_version)
        elif isinstance(msg, Ban):
            self.banned[msg.peer_id] = msg.reason
            self.view.leave(msg.peer_id)
            if msg.peer_id == self.key.peer_id:
                self._end(EXIT_BANNED, f"banned by the coordinator: {msg.reason}")
        elif isinstance(msg, RunEnd):
            self._end(0, f"the run ended at trainer step {msg.step}")
        elif isinstance(msg, JoinAgain):
            if msg.peer_id == self.key.peer_id and msg.heartbeat_seq > self._joined_after_seq:
                self._tasks.append(asyncio.create_task(self._join_again(msg), name="join-again"))

    async def _join_again(self, notice: JoinAgain) -> None:
        """The coordinator refused our heartbeat `notice.heartbeat_seq` (we are not a member): join again,
        unless a join sent after that beat happened meanwhile. A failed attempt is retried when the
        next refused beat brings the next notice."""
        async with self._joining:
            if self._bootstrap is None or notice.heartbeat_seq <= self._joined_after_seq:
                return
            log.warning("the coordinator refused our heartbeat %d (%s): joining again", notice.heartbeat_seq,
                        notice.reason)
            try:
                await self._join(self._bootstrap)
            except ProtocolError as exc:
                log.warning("join again failed (%s: %s); the next refused heartbeat retries", type(exc).__name__, exc)

    def _end(self, code: int, why: str) -> None:
        for cb in self.on_end:
            cb(code, why)

    def _discover(self, peer_id: str, addrs: list[str]) -> None:
        """Dial a peer learnt from the network, unless we have enough or already do."""
        if (peer_id == self.key.peer_id or peer_id in self._dialing or not addrs
                or peer_id in self.host.connected_peers() or len(self.host.connected_peers()) >= self.max_peers):
            return
        self._dialing.add(peer_id)

        async def dial() -> None:
            try:
                for addr in addrs:
                    try:
                        await self.host.connect(f"{addr}/p2p/{peer_id}", timeout=5)
                        return
                    except ProtocolError as exc:
                        log.debug("dial %s at %s failed: %s", peer_id, addr, exc)
            finally:
                self._dialing.discard(peer_id)
        self._tasks.append(asyncio.create_task(dial()))

    async def _stop_tasks(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()


def _expect(reply: object, kind: type) -> None:
    if not isinstance(reply, kind):
        raise UnexpectedReply(f"expected {kind.__name__} in reply, got {type(reply).__name__}")


async def _run_member(spec_path: str, bootstrap: str, key_path: str | None, role: str, leases: int,
                      report: str | None) -> None:
    import json
    import signal
    from pathlib import Path

    spec = RunSpec.model_validate_json(Path(spec_path).read_bytes())
    key = NodeKey.load_or_create(key_path) if key_path else NodeKey.generate()
    host = PeerHost(key)
    await host.start()
    member = RunMember(key, host, spec, role)  # type: ignore[arg-type]
    await member.join(bootstrap)
    from protocol.client import ONCE, CoordinatorClient

    work_ids = [g.work_id for g in await CoordinatorClient(member, retry=ONCE).lease(leases)] if leases else []
    if report:
        tmp = Path(report + ".tmp")
        tmp.write_text(json.dumps({"peer_id": key.peer_id, "work_ids": work_ids}))
        tmp.replace(report)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await member.leave("terminated")
    await host.stop()


def main() -> None:
    """`python -m protocol.member`: join a run, optionally hold leases, beat until SIGTERM, then leave."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--spec", required=True, help="run spec JSON")
    p.add_argument("--bootstrap", required=True, help="coordinator multiaddr (…/p2p/<id>)")
    p.add_argument("--key", help="key file (created if missing); a throwaway key otherwise")
    p.add_argument("--role", default="inference")
    p.add_argument("--leases", type=int, default=0, help="work leases to take and hold")
    p.add_argument("--report", help="write {peer_id, work_ids} here once joined")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_run_member(args.spec, args.bootstrap, args.key, args.role, args.leases, args.report))


if __name__ == "__main__":
    main()
