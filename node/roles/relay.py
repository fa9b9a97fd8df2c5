"""Relay role: mirror every policy version from the trainer's origin (parents first, each shard
verified) and serve it onward, so the trainer's uplink is not every node's bottleneck.

Invariant: the relay serves only verified shards (shardcast's store renames a file into place only
after its hashes pass); a gossiped `PolicyAnnounce` wakes the mirror at once instead of at the next poll.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from node.roles.common import join_run
from protocol.identity import NodeKey
from protocol.messages import PolicyAnnounce, RunSpec
from shardcast.fetch import Fetcher
from shardcast.manifest import TrustedPublishers
from shardcast.relay import mirror
from shardcast.server import ShardServer
from shardcast.store import Store

log = logging.getLogger(__name__)


class RelayNode:
    def __init__(self, key: NodeKey, spec: RunSpec, bootstrap: str, workdir: Path, port: int):
        self.key, self.spec, self.bootstrap, self.workdir, self.port = key, spec, bootstrap, workdir, port

    async def run(self, stop: asyncio.Event) -> None:
        store = Store(self.workdir / "shardcast")
        server = ShardServer(store)
        await server.start("127.0.0.1", self.port)
        member = await join_run(self.key, self.spec, "relay", self.bootstrap, stop)
        wake = asyncio.Event()

        async def on_policy(msg: PolicyAnnounce) -> None:
            wake.set()
        member.on_policy.append(on_policy)
        own = f"http://127.0.0.1:{self.port}"
        upstream = [s for s in self.spec.shardcast_sources if s.rstrip("/") != own][:1]
        trusted = TrustedPublishers([self.spec.trainer] if self.spec.trainer else [])
        try:
            async with Fetcher(store, upstream, trusted) as fetcher:
                await mirror(fetcher, self.spec.run_id, keep_last=self.spec.max_off_policy_steps + 4, poll_s=2.0,
                             stop=stop, wake=wake)
        finally:
            await member.leave("relay stopping")
            await member.host.stop()
            await server.stop()
