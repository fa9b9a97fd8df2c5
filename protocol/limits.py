"""Per-peer resource bounds, so that one peer cannot exhaust a coordinator, relay or origin.

`PeerLimiter` keeps, for each peer key (a libp2p peer id, or a client IP on HTTP), a token bucket
of requests and counts of requests and bytes in flight, plus one global in-flight cap that many
identities (Sybils) share. A request is admitted only if all of them have room; a refused request
costs the server one dictionary lookup, nothing is buffered for it.

Invariant: `sum(in flight) <= max_total_inflight` and, per key, `in flight <= max_inflight` and
`bytes in flight <= max_bytes_inflight`, at every moment. Not thread-safe: each server uses its
own limiter from its one event loop (trio thread for libp2p, asyncio for aiohttp).
`ConnectionCap` bounds open TCP connections per client IP for asyncio servers.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field


@dataclass
class LimitConfig:
    rate_per_s: float = 200.0
    """Sustained requests/s per peer. py-libp2p on 2 cores answers ~140-190 requests/s in total
    (docs/protocol.md), so an honest peer never reaches this; a flooder is cut to it."""
    burst: float = 400.0
    """Requests a quiet peer may send at once (token bucket depth)."""
    max_inflight: int = 32
    """Requests of one peer being read or handled at once (an inference node uses 1-2)."""
    max_bytes_inflight: int = 64 << 20
    """Request bytes of one peer buffered at once: four of the largest frames (16 MiB)."""
    max_total_inflight: int = 512
    """Requests in flight over all peers: the bound a crowd of Sybil identities shares."""
    max_keys: int = 100_000
    """Peers tracked; idle ones are forgotten first when this is exceeded."""


@dataclass
class _PeerState:
    tokens: float
    stamp: float
    inflight: int = 0
    bytes_inflight: int = 0


@dataclass
class PeerLimiter:
    cfg: LimitConfig = field(default_factory=LimitConfig)
    refused: int = 0
    """Requests refused so far (any reason)."""
    _peers: dict[str, _PeerState] = field(default_factory=dict)
    _total: int = 0

    def admit(self, key: str, now: float | None = None) -> bool:
        """Take one request slot for `key`; False (and nothing taken) if any bound is reached.
        Every True must be paired with one `release(key)`."""
        now = time.monotonic() if now is None else now
        st = self._peers.get(key)
        if st is None:
            if len(self._peers) >= self.cfg.max_keys:
                self._forget_idle(now)
            st = self._peers[key] = _PeerState(self.cfg.burst, now)
        st.tokens = min(self.cfg.burst, st.tokens + (now - st.stamp) * self.cfg.rate_per_s)
        st.stamp = now
        if st.tokens < 1 or st.inflight >= self.cfg.max_inflight or self._total >= self.cfg.max_total_inflight:
            self.refused += 1
            return False
        st.tokens -= 1
        st.inflight += 1
        self._total += 1
        return True

    def reserve_bytes(self, key: str, n: int) -> bool:
        """Count `n` more request bytes in flight for an admitted `key`; False if over its bound."""
        st = self._peers[key]
        if st.bytes_inflight + n > self.cfg.max_bytes_inflight:
            self.refused += 1
            return False
        st.bytes_inflight += n
        return True

    def release(self, key: str, nbytes: int = 0) -> None:
        st = self._peers.get(key)
        if st is None:
            return
        st.inflight -= 1
        st.bytes_inflight -= nbytes
        self._total -= 1

    def inflight(self, key: str) -> int:
        st = self._peers.get(key)
        return st.inflight if st else 0

    def _forget_idle(self, now: float) -> None:
        idle = [k for k, st in self._peers.items() if st.inflight == 0]
        for k in idle[: max(1, len(idle) // 2)]:
            del self._peers[k]


class ConnectionCap:
    """An asyncio protocol-factory wrapper: at most `per_ip` open connections per client IP (and
    `total` overall); a connection over either bound is aborted before its protocol sees a byte.
    For HTTP servers (`loop.create_server(ConnectionCap(runner.server, ...), host, port)`)."""

    def __init__(self, factory, per_ip: int = 256, total: int = 4096):
        self.factory, self.per_ip, self.total = factory, per_ip, total
        self.open: dict[str, int] = {}
        self.refused = 0

    def __call__(self) -> "_CappedProtocol":
        return _CappedProtocol(self)

    def _take(self, ip: str) -> bool:
        if self.open.get(ip, 0) >= self.per_ip or sum(self.open.values()) >= self.total:
            self.refused += 1
            return False
        self.open[ip] = self.open.get(ip, 0) + 1
        return True

    def _release(self, ip: str) -> None:
        left = self.open.get(ip, 1) - 1
        if left:
            self.open[ip] = left
        else:
            self.open.pop(ip, None)


class _CappedProtocol(asyncio.Protocol):
    def __init__(self, cap: ConnectionCap):
        self.cap, self.inner, self.ip = cap, None, None

    def connection_made(self, transport) -> None:
        ip = (transport.get_extra_info("peername") or ("?",))[0]
        if not self.cap._take(ip):
            transport.abort()
            return
        self.ip, self.inner = ip, self.cap.factory()
        self.inner.connection_made(transport)

    def connection_lost(self, exc) -> None:
        if self.inner is not None:
            self.cap._release(self.ip)
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()
