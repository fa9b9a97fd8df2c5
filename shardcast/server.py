"""HTTP serving of a store: the same server is an origin (publisher's store), a relay (a store
a mirror loop fills from upstream) or a peer (a store a fetch is filling).

Endpoints (all GET, under /shardcast):
  /runs                                -> {"runs": [...]}
  /{run}/versions                      -> {"versions": [held manifests], "complete": [verified payloads]}
  /{run}/{version}/manifest            -> the signed manifest JSON
  /{run}/{version}/have                -> {"shards": [held], "fetching": [being fetched now], "seed": bool}
  /{run}/{version}/shard/{index}       -> wire bytes (Range supported; sendfile)
Invariant: only files with final names are served, and those were verified before renaming
(see store.py), so a peer never relays bytes it has not checked. At most `max_concurrent`
shard bodies are in flight, and at most `max_concurrent // 2` for one client IP, so one client
cannot hold every slot; a request that waits longer than `queue_timeout` for a slot (or whose IP
holds its share) gets 503 with Retry-After, which fetchers read as "busy, try another source".
Every connection first passes a per-IP `ConnectionCap` (aborted if over it), every request a
per-IP `PeerLimiter` (rate, requests in flight): over it, 429.
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

from aiohttp import web

from protocol.limits import ConnectionCap, LimitConfig, PeerLimiter
from shardcast.seeding import SeedOffer
from shardcast.store import Store

log = logging.getLogger(__name__)

_RUN = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
DEFAULT_MAX_CONCURRENT = 16
"""Shard bodies sent at once: 16 x 64 MiB keeps a 10 Gbit/s uplink busy without thrashing disk."""
DEFAULT_QUEUE_TIMEOUT = 2.0
"""Seconds a shard request may wait for a slot before a 503 sends the client elsewhere."""
DEFAULT_MAX_CONNECTIONS_PER_IP = 256
"""Open connections one client IP may hold: a fetcher uses a few per source; 256 leaves room for a
whole local simulation on 127.0.0.1 and stops a junk-connection flood from one host."""
HTTP_LIMITS = LimitConfig(rate_per_s=1000.0, burst=2000.0, max_inflight=64, max_total_inflight=1024)
"""Per client IP. Generous because on one host (the local simulation) every peer is 127.0.0.1;
the shard-slot share below is what keeps one client from starving the others."""


def _run(request: web.Request) -> str:
    run = request.match_info["run"]
    if not _RUN.match(run) or run.startswith("."):
        raise web.HTTPBadRequest(text="bad run id")
    return run


def _int(request: web.Request, name: str) -> int:
    s = request.match_info[name]
    if not s.isdigit() or len(s) > 12:
        raise web.HTTPBadRequest(text=f"bad {name}")
    return int(s)


class ShardServer:
    """aiohttp application over a `Store`."""

    def __init__(self, store: Store, max_concurrent: int = DEFAULT_MAX_CONCURRENT, queue_timeout: float = DEFAULT_QUEUE_TIMEOUT,
                 uplink_bytes_per_s: float | None = None, limits: LimitConfig = HTTP_LIMITS,
                 max_connections_per_ip: int = DEFAULT_MAX_CONNECTIONS_PER_IP, seed: SeedOffer | None = None):
        self.store = store
        self.seed = seed
        """Super-seeding (an origin): hide shards already handed out `seed.copies` times (seeding.py)."""
        self.limiter = PeerLimiter(limits)
        self.per_client_slots = max(1, max_concurrent // 2)
        """Shard bodies one client IP may have in flight."""
        self._client_slots: dict[str, int] = {}
        self.uplink_bytes_per_s = uplink_bytes_per_s
        """If set, all shard bodies together are paced to this rate (emulates a thin uplink)."""
        self._uplink_free_at = 0.0
        self.queue_timeout = queue_timeout
        self._slots = asyncio.Semaphore(max_concurrent)
        self.bytes_served = 0
        self.busy_refusals = 0
        self.app = web.Application(middlewares=[self._limit])
        self.app.add_routes([
            web.get(path, handler, expect_handler=expect_without_echo) for path, handler in [
                ("/shardcast/runs", self._runs),
                ("/shardcast/{run}/versions", self._versions),
                ("/shardcast/{run}/{version}/manifest", self._manifest),
                ("/shardcast/{run}/{version}/have", self._have),
                ("/shardcast/{run}/{version}/shard/{index}", self._shard)]
        ])
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self.connections = ConnectionCap(lambda: self._runner.server(), per_ip=max_connections_per_ip)
        """Open TCP connections per client IP, checked before a byte is parsed."""
        self.port: int | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen; returns the bound port (pass 0 for any free port)."""
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        # Our own listener instead of web.TCPSite: every connection passes the per-IP cap first.
        self._listener = await asyncio.get_running_loop().create_server(self.connections, host, port)
        self.port = self._listener.sockets[0].getsockname()[1]
        log.info("shardcast server on http://%s:%d serving %s", host, self.port, self.store.root)
        return self.port

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _limit(self, request: web.Request, handler) -> web.StreamResponse:
        client = request.remote or "?"
        if not self.limiter.admit(client):
            raise web.HTTPTooManyRequests(text="rate limited", headers={"Retry-After": "1"})
        try:
            return await handler(request)
        finally:
            self.limiter.release(client)

    async def _runs(self, request: web.Request) -> web.Response:
        return web.json_response({"runs": self.store.runs()})

    async def _versions(self, request: web.Request) -> web.Response:
        run = _run(request)
        return web.json_response({"versions": self.store.versions(run), "complete": self.store.complete_versions(run)})

    async def _manifest(self, request: web.Request) -> web.StreamResponse:
        path = self.store.manifest_path(_run(request), _int(request, "version"))
        if not path.exists():
            raise web.HTTPNotFound(text="no such version")
        return web.FileResponse(path, headers={"Content-Type": "application/json"})

    async def _have(self, request: web.Request) -> web.Response:
        run, version = _run(request), _int(request, "version")
        held = self.store.held_shards(run, version)
        return web.json_response({"shards": held if self.seed is None else self.seed.offered(run, version, held),
                                  "fetching": sorted(self.store.fetching.get((run, version), ())), "seed": self.seed is not None})

    async def _shard(self, request: web.Request) -> web.StreamResponse:
        run, version, index = _run(request), _int(request, "version"), _int(request, "index")
        path = self.store.shard_path(run, version, index)
        if not path.exists():
            raise web.HTTPNotFound(text="shard not held")
        client = request.remote or "?"
        if self._client_slots.get(client, 0) >= self.per_client_slots:
            self.busy_refusals += 1
            raise web.HTTPServiceUnavailable(text="busy", headers={"Retry-After": "1"})
        self._client_slots[client] = self._client_slots.get(client, 0) + 1
        try:
            await asyncio.wait_for(self._slots.acquire(), self.queue_timeout)
        except asyncio.TimeoutError:
            self._release_client(client)
            self.busy_refusals += 1
            raise web.HTTPServiceUnavailable(text="busy", headers={"Retry-After": "1"}) from None
        try:
            if self.seed is not None and not self.seed.admit(run, version, index, request.query.get("last_resort") == "1"):
                raise _TooEarly(text="handed out already: fetch it from a peer")
            # prepare() sends the whole body (sendfile), so the slot is held for the transfer.
            if self.uplink_bytes_per_s:
                return await self._send_paced(request, path)
            resp = _PreparedOnce(path, headers={"Content-Type": "application/octet-stream"})
            await resp.prepare(request)
            self.bytes_served += resp.content_length or 0
            return resp
        finally:
            self._slots.release()
            self._release_client(client)

    def _release_client(self, client: str) -> None:
        left = self._client_slots.get(client, 1) - 1
        if left:
            self._client_slots[client] = left
        else:
            self._client_slots.pop(client, None)

    async def _send_paced(self, request: web.Request, path: Path) -> web.StreamResponse:
        """Send the file (or its requested range) in chunks, paced to the shared uplink rate."""
        size = path.stat().st_size
        rng = request.http_range
        start = rng.start or 0
        stop = size if rng.stop is None else min(rng.stop, size)
        if start < 0:
            start = max(0, size + start)
        if start >= stop and size:
            raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
        partial = rng.start is not None or rng.stop is not None
        resp = web.StreamResponse(status=206 if partial else 200, headers={"Content-Type": "application/octet-stream"})
        resp.content_length = stop - start
        if partial:
            resp.headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        with open(path, "rb") as f:
            f.seek(start)
            pos = start
            while pos < stop:
                chunk = f.read(min(_PACE_CHUNK, stop - pos))
                now = loop.time()
                begin = max(now, self._uplink_free_at)
                self._uplink_free_at = begin + len(chunk) / float(self.uplink_bytes_per_s or 1)
                if begin > now:
                    await asyncio.sleep(begin - now)
                await resp.write(chunk)
                pos += len(chunk)
                self.bytes_served += len(chunk)
        await resp.write_eof()
        return resp


class _TooEarly(web.HTTPClientError):
    """425 Too Early: a super-seeding origin handed this shard out already (aiohttp has no class)."""

    status_code = 425


async def expect_without_echo(request: web.Request) -> None:
    """aiohttp's default Expect handler echoes the header into its 417 body, and a non-UTF-8 value
    made that a 500 (found by benchmarks.fuzz; tests/fuzz/test_regressions.py). Same behaviour,
    without the echo."""
    if request.version >= (1, 1):
        if request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        else:
            raise web.HTTPExpectationFailed(text="unsupported Expect header")


_PACE_CHUNK = 256 << 10
"""Paced sends go out in 256 KiB chunks: fine-grained enough to share the uplink fairly."""


class _PreparedOnce(web.FileResponse):
    """A FileResponse that may be prepared inside the handler (to hold a slot for the whole
    transfer) and then returned; aiohttp's second prepare() becomes a no-op."""

    async def prepare(self, request):  # type: ignore[override]
        if self.prepared:
            return self._payload_writer
        return await super().prepare(request)
