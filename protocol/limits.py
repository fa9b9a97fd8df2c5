"""Per-peer resource bounds, so that one peer cannot exhaust a coordinator, relay or origin.

`PeerLimiter` keeps, for each peer key (a libp2p peer id, or a client IP on HTTP), a token bucket
of requests and counts of requests and bytes in flight, plus one global in-flight cap that many
identities (Sybils) share. A request is admitted only if all of them have room; a refused request
costs the server one dictionary lookup, nothing is buffered for it.

Invariant: `sum(in flight) <= max_total_inflight` and, per key, `in flight <= max_inflight` and
`bytes in flight <= max_bytes_inflight`, at every moment. Not thread-safe: each server uses its
own limiter from its one event loop (trio thread for libp2p, asyncio for aiohttp).
`ConnectionCap` bounds open TCP connections per client IP for asyncio servers; `ConnectionGuard`
bounds a libp2p host's inbound connections (open and attempted, per peer, per address and in
total: protocol/transport.py installs it in place of py-libp2p's inbound slots, which a closed
connection never gave back).
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


@dataclass
class ConnectionLimits:
    max_inbound: int = 250
    """Inbound connections open at once, over all peers: py-libp2p 0.8.1's own inbound cap (its 300
    connections less the 50 it keeps for dialling out), now with slots given back on close."""
    per_peer: int = 4
    """Inbound connections of one identity open at once (py-libp2p dials at most 3 to one peer)."""
    per_address: int = 128
    """Inbound connections from one IP open at once: the local simulation runs every node on
    127.0.0.1, so this is generous; on a real network it bounds one machine's share."""
    attempts_per_peer_per_s: float = 1.0
    """Sustained connection attempts of one identity (after the handshake names it). An honest member
    connects once and re-dials with a backoff (0.3 s doubling to 3 s, protocol/client.py)."""
    attempt_burst_per_peer: float = 10.0
    """Attempts a quiet identity may make at once (restarts, a coordinator restart)."""
    attempts_per_address_per_s: float = 20.0
    """Sustained connection attempts from one IP, counted before the handshake (its CPU is the cost)."""
    attempt_burst_per_address: float = 200.0
    """Attempts a quiet IP may make at once (a whole local simulation starting on 127.0.0.1)."""
    max_keys: int = 100_000
    """Peers and addresses tracked; idle ones are forgotten first when this is exceeded."""


@dataclass
class _Bucket:
    tokens: float
    stamp: float
    open: int = 0

    def take(self, rate: float, burst: float, now: float) -> bool:
        self.tokens = min(burst, self.tokens + (now - self.stamp) * rate)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class ConnectionGuard:
    """Inbound connections of a libp2p host: each address (before the handshake) and each identity
    (after it) gets a token bucket of attempts and a bound on connections open at once, and all of
    them together `max_inbound`. Every True of `open_address` / `open_peer` is paired with one
    `close_address` / `close_peer` when that connection ends, so churn never uses slots up.
    Not thread-safe: used from the libp2p (trio) thread only."""

    def __init__(self, cfg: ConnectionLimits | None = None):
        self.cfg = cfg or ConnectionLimits()
        self.refused: dict[str, int] = {}
        """Refused attempts by reason: address_rate, address_open, total_open, peer_rate, peer_open."""
        self.open_total = 0
        self._addresses: dict[str, _Bucket] = {}
        self._peers: dict[str, _Bucket] = {}

    def open_address(self, address: str, now: float | None = None) -> bool:
        """An inbound connection from `address` begins: count the attempt and take a slot (False: refuse it)."""
        cfg = self.cfg
        now = time.monotonic() if now is None else now
        b = self._bucket(self._addresses, address, cfg.attempt_burst_per_address, now)
        if not b.take(cfg.attempts_per_address_per_s, cfg.attempt_burst_per_address, now):
            return self._refuse("address_rate")
        if b.open >= cfg.per_address:
            return self._refuse("address_open")
        if self.open_total >= cfg.max_inbound:
            return self._refuse("total_open")
        b.open += 1
        self.open_total += 1
        return True

    def close_address(self, address: str) -> None:
        b = self._addresses.get(address)
        if b is not None and b.open > 0:
            b.open -= 1
            self.open_total -= 1

    def open_peer(self, peer_id: str, now: float | None = None) -> bool:
        """The connection's handshake named `peer_id`: count the attempt and take its slot (False: close it)."""
        cfg = self.cfg
        now = time.monotonic() if now is None else now
        b = self._bucket(self._peers, peer_id, cfg.attempt_burst_per_peer, now)
        if not b.take(cfg.attempts_per_peer_per_s, cfg.attempt_burst_per_peer, now):
            return self._refuse("peer_rate")
        if b.open >= cfg.per_peer:
            return self._refuse("peer_open")
        b.open += 1
        return True

    def close_peer(self, peer_id: str) -> None:
        b = self._peers.get(peer_id)
        if b is not None and b.open > 0:
            b.open -= 1

    def open_of(self, peer_id: str | None = None, address: str | None = None) -> int:
        """Connections open now of a peer, or from an address."""
        b = self._peers.get(peer_id) if peer_id is not None else self._addresses.get(address)
        return b.open if b else 0

    def _refuse(self, reason: str) -> bool:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return False

    def _bucket(self, table: dict[str, _Bucket], key: str, burst: float, now: float) -> _Bucket:
        b = table.get(key)
        if b is None:
            if len(table) >= self.cfg.max_keys:
                idle = [k for k, v in table.items() if v.open == 0]
                for k in idle[: max(1, len(idle) // 2)]:
                    del table[k]
            b = table[key] = _Bucket(burst, now)
        return b
