"""PeerHost: a libp2p host (gossipsub + request/response streams) usable from asyncio.

This is the one module that knows there are two event loops. py-libp2p is trio-native; the rest of
the node is asyncio (aiohttp). The libp2p host runs in its own thread under `trio.run`; every
public method here is an asyncio coroutine that hands work to the trio thread and awaits the
answer, and every inbound request or gossip message is handed to the asyncio loop. Callers see
bytes in, bytes out, peer ids as strings, and `TransportError`/`RequestTimeout` on failure.

Invariants: a request always ends within its timeout; a frame over its size limit is refused
before it is buffered; a handler's exception resets that one stream and nothing else; an inbound
connection holds a slot of `ConnectionGuard` (per address, per identity, in total) exactly while it
is open, and attempts beyond its rates are closed at once.

py-libp2p 0.8.1 caps inbound connections with a limiter whose slot each accepted connection holds
until the whole host stops (`Swarm._do_handle_inbound_connection` waits for the swarm's end, not the
connection's), so 250 connect/disconnect cycles of one peer left a coordinator deaf to everyone. We
work around it here, without patching the library: the host's inbound handler is replaced by
`_inbound`, which upgrades the connection with py-libp2p's own `upgrade_inbound_raw_conn` and
returns, giving its slots back, when that connection closes.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service

from protocol.errors import MessageTooLarge, RateLimited, RequestTimeout, TransportError
from protocol.identity import NodeKey
from protocol.limits import ConnectionGuard, ConnectionLimits, LimitConfig, PeerLimiter

log = logging.getLogger(__name__)

Handler = Callable[[str, bytes], Awaitable[bytes]]
"""An inbound request: (remote peer id, request bytes) -> reply bytes, run on the asyncio loop."""
GOSSIPSUB = TProtocol("/meshsub/1.0.0")
DEFAULT_MAX_FRAME = 16 << 20
_LEN = struct.Struct(">I")


@dataclass
class GossipConfig:
    degree: int = 6
    """Mesh degree D (gossipsub default)."""
    degree_low: int = 4
    degree_high: int = 12
    heartbeat_interval_s: int = 1
    """Mesh maintenance period; 1 s repairs the mesh quickly after churn."""
    max_messages_per_peer_per_s: float = 1000.0
    """py-libp2p's default (10/s per neighbour and topic) drops relayed heartbeats once a run has
    more than ~10 members behind one neighbour; 1000/s still bounds a flooding neighbour."""
    ip_diversity: bool = False
    """py-libp2p eclipse protection wants >= 3 distinct IPs in a mesh; on loopback (tests, the
    local simulation) every peer is 127.0.0.1, so it is off unless asked for."""
    queue_size: int = 4096
    """Messages buffered per subscription on the asyncio side; beyond this the newest are dropped."""


class Subscription:
    """Async iterator of (sender peer id, data) for one topic."""

    def __init__(self, topic: str, queue: asyncio.Queue):
        self.topic = topic
        self._queue = queue

    def __aiter__(self) -> AsyncIterator[tuple[str, bytes]]:
        return self

    async def __anext__(self) -> tuple[str, bytes]:
        return await self._queue.get()

    async def get(self, timeout: float | None = None) -> tuple[str, bytes]:
        return await asyncio.wait_for(self._queue.get(), timeout)


class PeerHost:
    """A libp2p peer on one TCP port; start() it inside a running asyncio loop."""

    def __init__(self, key: NodeKey, listen: str = "/ip4/127.0.0.1/tcp/0", gossip: GossipConfig | None = None,
                 max_frame: int = DEFAULT_MAX_FRAME, limits: LimitConfig | None = None,
                 connection_limits: ConnectionLimits | None = None):
        self.key = key
        self.limits = PeerLimiter(limits or LimitConfig())
        """Per-peer bounds on inbound requests (rate, in flight, bytes in flight); used in the libp2p thread."""
        self.connections = ConnectionGuard(connection_limits)
        """Bounds on inbound connections (open and attempted, per address, per peer, in total); libp2p thread."""
        self.peer_id = key.peer_id
        self._listen = listen
        self._gossip_cfg = gossip or GossipConfig()
        self._max_frame = max_frame
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._host: Any = None
        self._pubsub: Pubsub | None = None
        self._handlers: dict[str, tuple[Handler, int]] = {}
        self.addrs: list[str] = []

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self, timeout: float = 30.0) -> None:
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future = self._loop.create_future()
        self._thread = threading.Thread(target=self._thread_main, args=(ready,), name=f"libp2p-{self.peer_id[-6:]}",
                                        daemon=True)
        self._thread.start()
        await asyncio.wait_for(ready, timeout)

    async def stop(self, timeout: float = 10.0) -> None:
        if self._token is None or self._thread is None:
            return
        try:
            self._token.run_sync_soon(self._stop.set)
        except trio.RunFinishedError:
            pass
        await asyncio.to_thread(self._thread.join, timeout)
        self._token = None

    def _thread_main(self, ready: asyncio.Future) -> None:
        try:
            trio.run(self._trio_main, ready)
        except BaseException as exc:  # report start-up failure to the awaiting coroutine
            log.error("libp2p thread ended: %r", exc)
            self._post(ready, exc=TransportError(f"libp2p host failed: {exc!r}"))

    async def _trio_main(self, ready: asyncio.Future) -> None:
        cfg = self._gossip_cfg
        self._host = new_host(key_pair=create_new_key_pair(self.key.private_bytes()))
        # before run() starts the listeners, which call this attribute for every accepted connection
        self._host.get_network()._handle_inbound_connection = self._inbound
        router = GossipSub([GOSSIPSUB], degree=cfg.degree, degree_low=cfg.degree_low, degree_high=cfg.degree_high,
                           heartbeat_interval=cfg.heartbeat_interval_s, eclipse_protection_enabled=cfg.ip_diversity,
                           max_messages_per_topic_per_second=cfg.max_messages_per_peer_per_s)
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(self._host.run([multiaddr.Multiaddr(self._listen)]))
            self._pubsub = Pubsub(self._host, router)
            # py-libp2p numbers our messages from int(time.time()), +1 each: a peer that published
            # more than one message a second and restarts reuses numbers its peers still remember,
            # and they drop its new messages as duplicates ("Equivocation detected", for up to the
            # 120 s seen-cache window). Nanoseconds keep the numbering ahead of any earlier incarnation.
            self._pubsub.counter = time.time_ns()
            await stack.enter_async_context(background_trio_service(self._pubsub))
            await stack.enter_async_context(background_trio_service(router))
            await self._pubsub.wait_until_ready()
            self.addrs = [str(a) for a in self._host.get_addrs()]
            self._stop = trio.Event()
            self._token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._post(ready, result=None)
                await self._stop.wait()
                nursery.cancel_scope.cancel()

    async def _inbound(self, stream: Any, maddr: multiaddr.Multiaddr) -> None:
        """One accepted TCP connection, from accept to close (in place of py-libp2p's handler, see the
        module docstring): refused at once over its address's or its identity's bounds, else upgraded
        (security, muxer) by py-libp2p and held until it closes, then its slots are given back. TCP
        only (no pre-multiplexed QUIC path), and py-libp2p's allow/deny gate, empty unless configured,
        is not consulted: nothing here configures one."""
        swarm = self._host.get_network()
        remote = stream.get_remote_address() if hasattr(stream, "get_remote_address") else None
        address = str(remote[0]) if remote else "?"
        if not self.connections.open_address(address):
            log.debug("inbound connection from %s refused: over its address's connection bounds", address)
            await _close_quietly(stream)
            return
        try:
            try:
                muxed = await swarm.upgrade_inbound_raw_conn(RawConnection(stream, False), maddr)
            except Exception as exc:  # a failed handshake, a timeout, py-libp2p's own limits
                log.debug("inbound connection from %s not upgraded: %s: %s", address, type(exc).__name__, exc)
                await _close_quietly(stream)
                return
            peer = str(muxed.peer_id)
            conn = next((c for c in swarm.connections.get(muxed.peer_id, ()) if c.muxed_conn is muxed), muxed)
            if not self.connections.open_peer(peer):
                log.info("inbound connection of %s from %s closed: over its connection bounds", peer, address)
                await _close_quietly(conn)
                return
            try:
                await conn.event_closed.wait()
            finally:
                self.connections.close_peer(peer)
        finally:
            self.connections.close_address(address)

    # ---- crossing ----------------------------------------------------------------------------
    def _post(self, fut: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
        def settle() -> None:
            if not fut.done():
                fut.set_exception(exc) if exc is not None else fut.set_result(result)
        try:
            self._loop.call_soon_threadsafe(settle)
        except RuntimeError:  # asyncio loop already closed: nobody is waiting any more
            pass

    async def _on_trio(self, afn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run `afn(*args)` in the trio thread; await its result here."""
        if self._token is None:
            raise TransportError("peer host is not running")
        fut = self._loop.create_future()

        async def runner() -> None:
            try:
                self._post(fut, result=await afn(*args))
            except trio.Cancelled:
                self._post(fut, exc=TransportError("peer host stopped"))
                raise
            except Exception as exc:
                self._post(fut, exc=exc)

        try:
            self._token.run_sync_soon(lambda: self._nursery.start_soon(runner))
        except trio.RunFinishedError:
            raise TransportError("peer host stopped") from None
        return await fut

    async def _on_asyncio(self, coro: Awaitable[Any]) -> Any:
        """From the trio thread: run `coro` on the asyncio loop and await its result."""
        cf = asyncio.run_coroutine_threadsafe(coro, self._loop)
        done = trio.Event()
        token = self._token
        cf.add_done_callback(lambda _: token.run_sync_soon(done.set))
        try:
            await done.wait()
        except trio.Cancelled:
            cf.cancel()
            raise
        return cf.result()

    # ---- peers -------------------------------------------------------------------------------
    async def connect(self, addr: str, timeout: float = 10.0) -> str:
        """Dial a full multiaddr (…/p2p/<peer id>); returns the peer id."""
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except Exception as exc:
            raise TransportError(f"bad multiaddr {addr!r}: {exc}") from None
        if str(info.peer_id) == self.peer_id:
            return self.peer_id

        async def dial() -> str:
            # An explicit dial is new information (e.g. a restarted coordinator on a new port):
            # lift py-libp2p's negative cache for the peer, or it refuses to try for a while.
            # Its old addresses go too: py-libp2p prefers any non-loopback address it once learnt
            # (identify) over the loopback one we are given, and dials only those.
            network = self._host.get_network()
            if hasattr(network, "unblock_peer"):
                network.unblock_peer(info.peer_id)
            if info.peer_id not in network.connections:
                self._host.get_peerstore().clear_addrs(info.peer_id)
            with trio.move_on_after(timeout) as scope:
                await self._host.connect(info)
            if scope.cancelled_caught:
                raise RequestTimeout(f"connect to {addr} timed out after {timeout}s")
            return str(info.peer_id)
        return await self._wrap(self._on_trio(dial), f"connect {addr}")

    def connected_peers(self) -> list[str]:
        return [str(p) for p in list(self._host.get_network().connections.keys())] if self._host else []

    async def disconnect(self, peer_id: str) -> None:
        await self._wrap(self._on_trio(self._host.disconnect, ID.from_base58(peer_id)), f"disconnect {peer_id}")

    # ---- gossip ------------------------------------------------------------------------------
    async def subscribe(self, topic: str, validator: Callable[[bytes], bool] | None = None) -> Subscription:
        """Join `topic`; `validator` (called in the libp2p thread, must be quick and pure) stops
        invalid messages from being delivered or forwarded."""
        queue: asyncio.Queue = asyncio.Queue(self._gossip_cfg.queue_size)

        def deliver(item: tuple[str, bytes]) -> None:
            try:
                queue.put_nowait(item)
            except asyncio.QueueFull:
                log.warning("gossip queue for %s full; dropping a message from %s", topic, item[0])

        async def sub() -> None:
            if validator is not None:
                self._pubsub.set_topic_validator(topic, lambda _peer, msg: _safe(validator, msg.data), False)
            subscription = await self._pubsub.subscribe(topic)

            async def pump() -> None:
                while True:
                    msg = await subscription.get()
                    sender = _peer_str(msg.from_id)
                    if sender != self.peer_id:
                        self._loop.call_soon_threadsafe(deliver, (sender, bytes(msg.data)))
            self._nursery.start_soon(pump)
        await self._wrap(self._on_trio(sub), f"subscribe {topic}")
        return Subscription(topic, queue)

    async def publish(self, topic: str, data: bytes) -> None:
        await self._wrap(self._on_trio(self._pubsub.publish, topic, data), f"publish {topic}")

    # ---- request / response -------------------------------------------------------------------
    def serve(self, protocol: str, handler: Handler, max_request: int | None = None) -> None:
        """Answer requests on `protocol` with `handler` (an asyncio coroutine function)."""
        limit = max_request or self._max_frame

        async def on_stream(stream: Any) -> None:
            remote = str(stream.muxed_conn.peer_id)
            nbytes = 0
            admitted = self.limits.admit(remote)
            try:
                if not admitted:  # nothing is read or buffered for a peer over its bounds
                    raise RateLimited(f"{remote} over its request bounds")
                with trio.fail_after(30):
                    (n,) = _LEN.unpack(await _read_exact(stream, _LEN.size))
                    if n > limit:
                        raise MessageTooLarge(f"frame of {n} bytes exceeds {limit}")
                    if not self.limits.reserve_bytes(remote, n):
                        raise RateLimited(f"{remote} over its bytes in flight")
                    nbytes = n
                    request = await _read_exact(stream, n)
                reply = await self._on_asyncio(handler(remote, request))
                with trio.fail_after(30):
                    await _write_frame(stream, reply)
                    await stream.close()
            except Exception as exc:  # one bad stream never takes the host down
                level = logging.DEBUG if isinstance(exc, RateLimited) else logging.WARNING
                log.log(level, "request on %s from %s failed: %s: %s", protocol, remote, type(exc).__name__, exc)
                with trio.move_on_after(1):
                    try:
                        await stream.reset()
                    except Exception:
                        pass
            finally:
                if admitted:
                    self.limits.release(remote, nbytes)

        async def register() -> None:
            self._host.set_stream_handler(TProtocol(protocol), on_stream)
        if self._token is None:
            raise TransportError("start() the host before serve()")
        self._handlers[protocol] = (handler, limit)
        self._token.run_sync_soon(lambda: self._nursery.start_soon(register))

    async def request(self, peer_id: str, protocol: str, data: bytes, timeout: float = 10.0,
                      max_reply: int | None = None) -> bytes:
        """Send one request on a fresh stream and return the reply; `RequestTimeout` after `timeout`."""
        if len(data) > self._max_frame:
            raise MessageTooLarge(f"request of {len(data)} bytes exceeds {self._max_frame}")
        limit = max_reply or self._max_frame

        async def exchange() -> bytes:
            with trio.move_on_after(timeout) as scope:
                stream = await self._host.new_stream(ID.from_base58(peer_id), [TProtocol(protocol)])
                try:
                    await _write_frame(stream, data)
                    reply = await _read_frame(stream, limit)
                finally:
                    with trio.move_on_after(1):
                        await stream.close()
                return reply
            raise RequestTimeout(f"{protocol} to {peer_id} got no reply within {timeout}s")
        return await self._wrap(self._on_trio(exchange), f"{protocol} to {peer_id}")

    async def _wrap(self, aw: Awaitable[Any], what: str) -> Any:
        try:
            return await aw
        except (TransportError, MessageTooLarge):
            raise
        except Exception as exc:
            raise TransportError(f"{what}: {type(exc).__name__}: {exc}") from exc


async def _close_quietly(conn: Any) -> None:
    with trio.move_on_after(2):
        try:
            await conn.close()
        except Exception:
            pass


async def _read_exact(stream: Any, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.read(n - len(buf))
        if not chunk:
            raise TransportError(f"stream closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


async def _read_frame(stream: Any, limit: int) -> bytes:
    (n,) = _LEN.unpack(await _read_exact(stream, _LEN.size))
    if n > limit:
        raise MessageTooLarge(f"frame of {n} bytes exceeds {limit}")
    return await _read_exact(stream, n)


async def _write_frame(stream: Any, data: bytes) -> None:
    await stream.write(_LEN.pack(len(data)) + data)


def _peer_str(raw: bytes) -> str:
    try:
        return str(ID(raw))
    except Exception:
        return "?"


def _safe(validator: Callable[[bytes], bool], data: bytes) -> bool:
    try:
        return bool(validator(bytes(data)))
    except Exception:
        return False


def peer_info(addr: str):  # noqa: ANN201 (libp2p's PeerInfo)
    """The libp2p peer info of a `/ip4/.../p2p/<id>` multiaddr (the test peers that dial a coordinator)."""
    return info_from_p2p_addr(multiaddr.Multiaddr(addr))
