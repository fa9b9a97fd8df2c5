"""RunNetwork: signed, typed messages of one run over a PeerHost.

Invariant: nothing reaches a handler unless its envelope verified (signature, run id, clock
window, fresh nonce, well-formed body), and for requests the envelope's signer is the peer at
the other end of the authenticated stream. Anything else is counted under its error's name,
logged with the peer, answered with a `Refusal` naming the reason, and the node goes on serving.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from protocol.envelope import Opened, ReplayGuard, open_envelope, peek_signer, seal
from protocol.errors import (REFUSALS, ExpiredMessage, ProtocolError, Refused, ReplayedMessage, SignerMismatch, TransportError,
                             UnsupportedRequest)
from protocol.identity import NodeKey
from protocol.messages import Message, Refusal
from protocol.transport import PeerHost, Subscription

log = logging.getLogger(__name__)

RequestHandler = Callable[[Opened], Awaitable[Message]]
"""Answers one verified request; raise a `Refused` subclass to refuse with that reason."""
GossipHandler = Callable[[Opened], Awaitable[None]]

REPLAY_LOG_EVERY_S = 10.0
"""Replayed or expired gossip is logged as one line per this many seconds, not one per message: peers
hand a restarted coordinator their gossip history (walk-through restarts: 181 replays in 8 s, 44 in
one second; 70 messages 130-142 s old in one second)."""


class _StaleGossipLog:
    """Counts replayed/expired gossip and logs one line per REPLAY_LOG_EVERY_S; called from the
    asyncio side and from the libp2p thread (the gossip validator), hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unlogged = 0
        self._logged_at = float("-inf")

    def __call__(self, where: str, sender: str, exc: ProtocolError) -> None:
        log.debug("gossip %s %s refused: %s: %s", where, sender, type(exc).__name__, exc)
        with self._lock:
            self._unlogged += 1
            now = time.monotonic()
            if now - self._logged_at < REPLAY_LOG_EVERY_S:
                return
            count, self._unlogged, self._logged_at = self._unlogged, 0, now
        log.info("replayed or expired gossip refused: %d message(s) since the last such line (e.g. %s %s: %s: %s); "
                 "peers re-send their gossip history after a restart", count, where, sender, type(exc).__name__, exc)


class RunNetwork:
    """The run's gossip topic and request protocol, with every message signed and checked."""

    def __init__(self, host: PeerHost, key: NodeKey, run_id: str, max_skew_s: float = 120.0):
        self.host = host
        self.key = key
        self.run_id = run_id
        self.topic = f"/primerl/{run_id}/announce/1"
        self.rpc_protocol = f"/primerl/{run_id}/rpc/1"
        self.max_skew_s = max_skew_s
        self.guard = ReplayGuard(max_skew_s)
        self.refused: Counter[str] = Counter()
        """Inbound messages refused, by reason (error class name)."""
        self._request_handlers: dict[str, RequestHandler] = {}
        self._gossip_handlers: list[GossipHandler] = []
        self._pump: asyncio.Task | None = None
        self._subscription: Subscription | None = None
        self._stale = _StaleGossipLog()

    @property
    def peer_id(self) -> str:
        return self.key.peer_id

    def open(self, data: bytes) -> Opened:
        return open_envelope(data, self.run_id, self.guard, max_skew_s=self.max_skew_s)

    def seal(self, message: Message) -> bytes:
        return seal(self.key, self.run_id, message)

    # ---- requests ------------------------------------------------------------------------------
    def serve(self, message_type: type[Message], handler: RequestHandler) -> None:
        """Answer requests whose body is `message_type`; the first call starts serving the protocol."""
        first = not self._request_handlers
        self._request_handlers[message_type.model_fields["type"].default] = handler
        if first:
            self.host.serve(self.rpc_protocol, self._on_request)

    async def _on_request(self, remote: str, data: bytes) -> bytes:
        try:
            opened = self.open(data)
            if opened.signer != remote:
                raise SignerMismatch(f"envelope signed by {opened.signer}, stream from {remote}")
            handler = self._request_handlers.get(opened.message.type)
            if handler is None:
                raise UnsupportedRequest(f"no handler for {opened.message.type}")
            return self.seal(await handler(opened))
        except ProtocolError as exc:
            reason = type(exc).__name__
            self.refused[reason] += 1
            log.info("refused request from %s: %s: %s", remote, reason, exc)
            return self.seal(Refusal(reason=reason, detail=str(exc)[:500]))
        except Exception as exc:  # a handler bug must not take the node down; the peer learns little
            self.refused["InternalError"] += 1
            log.exception("request handler failed for %s", remote)
            return self.seal(Refusal(reason="InternalError", detail=type(exc).__name__))

    async def request(self, peer_id: str, message: Message, timeout: float = 10.0) -> Message:
        """Send a signed request; return the verified reply. A `Refusal` reply raises the matching
        `Refused` subclass (or plain `Refused` for envelope-level reasons)."""
        reply_bytes = await self.host.request(peer_id, self.rpc_protocol, self.seal(message), timeout=timeout)
        reply = self.open(reply_bytes)
        if reply.signer != peer_id:
            raise TransportError(f"reply signed by {reply.signer}, expected {peer_id}")
        if isinstance(reply.message, Refusal):
            cls = REFUSALS.get(reply.message.reason, Refused)
            raise cls(f"{reply.message.reason}: {reply.message.detail}", reason=reply.message.reason)
        return reply.message

    # ---- gossip --------------------------------------------------------------------------------
    async def start_gossip(self) -> None:
        """Subscribe to the run topic; messages that fail verification are neither delivered nor forwarded."""
        if self._subscription is not None:
            return
        self._subscription = await self.host.subscribe(self.topic, validator=self._gossip_valid)
        self._pump = asyncio.create_task(self._deliver(), name=f"gossip-{self.run_id}")

    def on_gossip(self, handler: GossipHandler) -> None:
        self._gossip_handlers.append(handler)

    async def gossip(self, message: Message) -> None:
        """Sign `message` and gossip it to every member on the run's topic."""
        await self.host.publish(self.topic, self.seal(message))

    def _gossip_valid(self, data: bytes) -> bool:
        # Runs in the libp2p thread: stateless checks only (the replay guard lives on this side).
        try:
            open_envelope(data, self.run_id, None, max_skew_s=self.max_skew_s)
            return True
        except ExpiredMessage as exc:
            self._stale("from", peek_signer(data), exc)
            return False
        except ProtocolError as exc:
            log.info("gossip from %s dropped before forwarding: %s: %s", peek_signer(data), type(exc).__name__, exc)
            return False

    async def _deliver(self) -> None:
        async for sender, data in self._subscription:
            try:
                opened = self.open(data)
            except (ReplayedMessage, ExpiredMessage) as exc:
                self.refused[type(exc).__name__] += 1
                self._stale("via", sender, exc)
                continue
            except ProtocolError as exc:
                self.refused[type(exc).__name__] += 1
                log.info("gossip via %s refused: %s: %s", sender, type(exc).__name__, exc)
                continue
            for handler in self._gossip_handlers:
                try:
                    await handler(opened)
                except ProtocolError as exc:
                    self.refused[type(exc).__name__] += 1
                    log.info("gossip %s from %s refused: %s", opened.message.type, opened.signer, exc)
                except Exception:
                    log.exception("gossip handler failed on %s from %s", opened.message.type, opened.signer)

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            try:
                await self._pump
            except (asyncio.CancelledError, Exception):
                pass

