"""A fault-injecting TCP proxy: every link of the chaos network runs through one of these.

Each `Link` forwards one listening port on 127.0.0.1 to one target port and can be told, at any
moment, to add one-way latency to every chunk, to emulate packet loss, or to partition (cut every
open connection and refuse new ones). It works at the TCP level, below libp2p's Noise and below
HTTP, so neither side can tell it is there except by the faults.

Loss, honestly: TCP hides lost packets behind retransmission, so what an application sees of
loss is a stall of about one retransmission timeout. A chunk "lost" here is held back for
`LOSS_STALL_S` before it is sent, which is the effect of a lost segment on the stream (Linux's
minimum RTO is 200 ms). Bytes are never dropped or reordered inside a connection.

All links of one proxy share one asyncio loop in a background thread; the control methods are
thread-safe and return at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

LOSS_STALL_S = 0.2
"""What a lost segment costs a TCP stream: Linux's minimum retransmission timeout (200 ms)."""
CHUNK = 64 << 10


@dataclass
class LinkFaults:
    latency_s: float = 0.0
    """Added one-way delay per chunk, each direction."""
    loss: float = 0.0
    """Probability that a chunk is "lost" (held back `LOSS_STALL_S`)."""
    partitioned: bool = False
    """Open connections are cut and new ones closed at once."""


@dataclass
class Link:
    name: str
    listen_port: int
    target_port: int
    faults: LinkFaults = field(default_factory=LinkFaults)
    connections: int = 0
    refused: int = 0
    bytes: int = 0
    _writers: set = field(default_factory=set)


class FaultProxy:
    """Owns the links and the loop thread they run on."""

    def __init__(self, seed: int = 0):
        self.links: dict[str, Link] = {}
        self._rng = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.Server] = []
        self._thread = threading.Thread(target=self._loop.run_forever, name="faultproxy", daemon=True)
        self._thread.start()

    def add(self, name: str, target_port: int, listen_port: int = 0) -> Link:
        """Start forwarding 127.0.0.1:listen_port -> 127.0.0.1:target_port; returns the link."""
        link = Link(name, listen_port, target_port)
        server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(lambda r, w: self._accept(link, r, w), "127.0.0.1", listen_port), self._loop).result(10)
        link.listen_port = server.sockets[0].getsockname()[1]
        self._servers.append(server)
        self.links[name] = link
        return link

    def set_faults(self, names: list[str], latency_s: float = 0.0, loss: float = 0.0, partitioned: bool = False) -> None:
        def apply() -> None:
            for n in names:
                link = self.links[n]
                link.faults = LinkFaults(latency_s, loss, partitioned)
                if partitioned:
                    for w in list(link._writers):
                        w.transport.abort()
        self._loop.call_soon_threadsafe(apply)

    def heal(self, names: list[str] | None = None) -> None:
        self.set_faults(list(self.links) if names is None else names)

    def close(self) -> None:
        """Stop listening, cut every open connection (its pipes end on the running loop), then stop the loop."""
        async def shutdown() -> None:
            for server in self._servers:
                server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
            except TimeoutError:
                log.warning("fault proxy: connections still open after 5 s; stopping the loop under them")
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _accept(self, link: Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if link.faults.partitioned:
            link.refused += 1
            writer.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", link.target_port), 5)
        except (OSError, asyncio.TimeoutError):
            writer.transport.abort()  # the target is down (killed, restarting): the client sees a reset
            return
        link.connections += 1
        link._writers.update((writer, up_w))
        try:
            await asyncio.gather(self._pipe(link, reader, up_w), self._pipe(link, up_r, writer))
        finally:
            link._writers.discard(writer)
            link._writers.discard(up_w)
            for w in (writer, up_w):
                w.transport.abort()

    async def _pipe(self, link: Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Latency is applied per chunk in arrival order, on one task per direction, so bytes keep
        # their order; a chunk that arrives during another's delay waits behind it (as in a queue).
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                f = link.faults
                if f.partitioned:
                    break
                delay = f.latency_s + (LOSS_STALL_S if f.loss and self._rng.random() < f.loss else 0.0)
                if delay:
                    await asyncio.sleep(delay)
                writer.write(data)
                link.bytes += len(data)
                await writer.drain()
        except (OSError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.transport.abort()
