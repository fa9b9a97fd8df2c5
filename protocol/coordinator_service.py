"""The coordinator on the network: answers joins, lease requests and submissions; tracks heartbeats.

Binds a `Coordinator` (durable state) to a `RunNetwork` (signed messages over libp2p). Everything
inbound is verified by RunNetwork first; a refusal goes back to the peer as a typed reason. A
sweeper ejects dead members and re-grants their work; new policy versions cancel stale leases.

Run it as a process (tests use this for SIGKILL/restart):
    python -m protocol.coordinator_service --dir D --key K --spec spec.json [--port 0] [--addr-file F]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from pathlib import Path

from protocol.coordinator import Coordinator
from protocol.envelope import Opened
from protocol.errors import ProtocolError
from protocol.identity import NodeKey
from protocol.messages import (Ban, Heartbeat, Join, JoinAccepted, LeaseGrant, LeaseRequest, Leave, Message,
                               PolicyAnnounce, RolloutSubmission, RunSpec, SubmissionReceipt, WorkCancel)
from protocol.network import RunNetwork
from protocol.transport import PeerHost

log = logging.getLogger(__name__)

MAX_GROUP = 256
"""Most submissions stored by one fsync + commit (bounds the latency of the last one in a group)."""


class CoordinatorService:
    def __init__(self, key: NodeKey, coordinator: Coordinator, host: PeerHost):
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

    @property
    def spec(self) -> RunSpec:
        return self.state.spec

    async def start(self) -> None:
        self.net.serve(Join, self._on_join)
        self.net.serve(LeaseRequest, self._on_lease_request)
        self.net.serve(RolloutSubmission, self._on_submission)
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

    # ---- requests ------------------------------------------------------------------------------
    async def _on_join(self, o: Opened) -> JoinAccepted:
        reply = self.state.join(o.signer, o.message, time.time())
        log.info("member %s joined as %s", o.signer, o.message.role)
        return reply

    async def _on_lease_request(self, o: Opened) -> LeaseGrant:
        return self.state.grant_lease(o.signer, time.time())

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
            for (_, fut), result in zip(batch, results):
                if not fut.done():
                    fut.set_exception(result) if isinstance(result, Exception) else fut.set_result(result)

    # ---- gossip --------------------------------------------------------------------------------
    async def _on_gossip(self, o: Opened) -> None:
        msg = o.message
        if isinstance(msg, Heartbeat):
            self.state.heartbeat(o.signer, msg, time.time())
        elif isinstance(msg, Leave):
            released = self.state.leave(o.signer, time.time())
            log.info("member %s left (%s); %d leases back in the pool", o.signer, msg.reason, len(released))

    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.spec.heartbeat_interval_s / 2)
            try:
                dead, released = self.state.sweep(time.time())
                if dead or released:
                    log.info("sweep: dead %s; work back in the pool %s", dead, released)
            except Exception:
                log.exception("sweep failed")

    async def _beat(self) -> None:
        while True:
            self._seq += 1
            try:
                await self.net.publish(Heartbeat(seq=self._seq, role="coordinator", addrs=self.host.addrs[:16]))
            except ProtocolError as exc:
                log.warning("coordinator heartbeat not sent: %s", exc)
            await asyncio.sleep(self.spec.heartbeat_interval_s)

    # ---- announcements -------------------------------------------------------------------------
    async def announce_policy(self, version: int, manifest_hash: str, parent_version: int = -1) -> list[int]:
        """Record and gossip a new policy version; cancel (and gossip) leases now too stale."""
        stale = self.state.advance_policy(version, manifest_hash, time.time())
        await self.publish(PolicyAnnounce(version=version, manifest_hash=manifest_hash, parent_version=parent_version))
        if stale:
            await self.publish(WorkCancel(work_ids=stale, policy_version=version))
        return stale

    async def ban(self, peer_id: str, reason: str, until: float | None = None) -> None:
        self.state.ban(peer_id, reason, time.time(), until)
        await self.publish(Ban(peer_id=peer_id, reason=reason, until=until))

    async def publish(self, message: Message) -> None:
        await self.net.publish(message)


async def serve_forever(directory: Path, key_path: Path, spec_path: Path, listen: str, addr_file: Path | None,
                        policy_version: int | None) -> None:
    key = NodeKey.load_or_create(key_path)
    spec = RunSpec.model_validate_json(spec_path.read_bytes())
    host = PeerHost(key, listen)
    await host.start()
    service = CoordinatorService(key, Coordinator(directory, spec), host)
    await service.start()
    if policy_version is not None and service.state.ledger.current_version < policy_version:
        await service.announce_policy(policy_version, "0" * 64)
    if addr_file is not None:
        tmp = addr_file.with_suffix(".tmp")
        tmp.write_text(host.addrs[0] + "\n")
        tmp.replace(addr_file)
    log.info("coordinator of run %s listening on %s", spec.run_id, host.addrs)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await service.stop()
    service.state.close()
    await host.stop()


def main() -> None:
    p = argparse.ArgumentParser(description="run a coordinator (protocol only: leases, submissions, membership)")
    p.add_argument("--dir", type=Path, required=True, help="state directory (SQLite + rollouts)")
    p.add_argument("--key", type=Path, required=True, help="coordinator key file (created if missing)")
    p.add_argument("--spec", type=Path, required=True, help="run spec JSON (its coordinator must be this key)")
    p.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0", help="libp2p listen multiaddr")
    p.add_argument("--addr-file", type=Path, help="write the full /p2p multiaddr here once listening")
    p.add_argument("--policy-version", type=int, help="announce this policy version at start if newer")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve_forever(args.dir, args.key, args.spec, args.listen, args.addr_file, args.policy_version))


if __name__ == "__main__":
    main()
