"""Relay role: mirror every policy version from the trainer's origin (parents first, each shard
verified) and serve it onward, so the trainer's uplink is not every node's bottleneck.

Invariant: the relay serves only verified shards (shardcast's store renames a file into place only
after its hashes pass); a gossiped `PolicyAnnounce` wakes the mirror at once instead of at the next poll.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from urllib.parse import urlsplit

from node.recipe import Recipe
from protocol.client import CoordinatorClient
from protocol.identity import NodeKey
from protocol.messages import PolicyAnnounce, RunSpec
from shardcast.fetch import Fetcher
from shardcast.manifest import TrustedPublishers
from shardcast.relay import mirror
from shardcast.server import ShardServer
from shardcast.store import Store

log = logging.getLogger(__name__)


class RelayNode:
    def __init__(self, key: NodeKey, spec: RunSpec, bootstrap: str, workdir: Path, port: int, host: str = "127.0.0.1",
                 store: Store | None = None):
        """`store`: the host's shardcast store (`join --store`; default WORKDIR/shardcast): a relay beside
        the trainer on one host serves the trainer's own files and mirrors nothing twice."""
        self.key, self.spec, self.bootstrap, self.workdir, self.port, self.host = key, spec, bootstrap, workdir, port, host
        self.store = store or Store(workdir / "shardcast")

    async def run(self, stop: asyncio.Event) -> None:
        store = self.store
        server = ShardServer(store)
        await server.start(self.host, self.port)
        client = await CoordinatorClient.connect(self.key, self.spec, "relay", self.bootstrap, stop,
                                                listen=f"/ip4/{self.host}/tcp/0")
        wake = asyncio.Event()

        async def on_policy(msg: PolicyAnnounce) -> None:
            wake.set()
        client.on_policy(on_policy)
        upstream = mirror_sources(self.spec, self.host, self.port)
        trusted = TrustedPublishers([self.spec.trainer] if self.spec.trainer else [])
        try:
            async with Fetcher(store, upstream, trusted) as fetcher:
                await mirror(fetcher, self.spec.run_id, keep_last=self.spec.max_off_policy_steps + 4, poll_s=2.0,
                             stop=stop, wake=wake)
        finally:
            await client.close("relay stopping")
            await server.stop()


def other_sources(spec: RunSpec, host: str, port: int) -> list[str]:
    """The spec's shardcast sources other than the server at (host, port)."""
    return [s for s in spec.shardcast_sources if not _is_own(s, host, port)]


def mirror_sources(spec: RunSpec, host: str, port: int) -> list[str]:
    """Where a relay mirrors from: the first other source (the trainer's origin); every other
    source when the trainer super-seeds (it hands each shard out `super_seed_copies` times, so
    relays must trade with each other)."""
    others = other_sources(spec, host, port)
    return others if Recipe.of(spec).super_seed_copies else others[:1]


def _is_own(url: str, host: str, port: int) -> bool:
    """Whether a shardcast source URL is this relay's own server (never mirror from yourself)."""
    parsed = urlsplit(url)
    if parsed.port != port:
        return False
    names = {"127.0.0.1", "localhost", host}
    if host == "0.0.0.0":  # every address of this machine is ours
        names |= {socket.gethostname(), socket.getfqdn()}
        try:
            names |= set(socket.gethostbyname_ex(socket.gethostname())[2])
        except OSError:
            pass
    return parsed.hostname in names
