"""The signed envelope every message travels in, and the replay guard that reads it.

Invariant: `open_envelope` returns a message only if (1) the bytes parse exactly (no trailing or
missing byte), (2) the Ed25519 signature over everything before it verifies under the embedded
signer key, (3) the run id is ours, (4) the timestamp is within `max_skew_s` of our clock, (5) the
(signer, nonce) pair was not seen in that window, and (6) the body decodes to a valid message.
Each failure raises its own `ProtocolError` subclass, so the caller can log the reason and go on.

Wire layout (big-endian), signed bytes = domain tag + everything up to the signature:
    magic "PRLN" | format u8 = 1 | signer 32 | timestamp_ms u64 | nonce 16 |
    run_id_len u8 | run_id | body_len u32 | body | signature 64
The signed bytes are the transmitted bytes, so there is exactly one encoding to agree on.
"""

from __future__ import annotations

import os
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass

from protocol.errors import ExpiredMessage, MalformedMessage, MessageTooLarge, ReplayedMessage, WrongRun
from protocol.identity import NodeKey, peer_id_from_public_bytes, verify
from protocol.messages import MAX_BODY_BYTES, Message, decode_message, encode_message

MAGIC = b"PRLN"
FORMAT = 1
_DOMAIN = b"primerl-node/envelope/v1\x00"
_HEAD = struct.Struct(">4sB32sQ16sB")  # magic, format, signer, timestamp_ms, nonce, run_id_len
_SIG_LEN = 64
MAX_ENVELOPE_BYTES = _HEAD.size + 255 + 4 + MAX_BODY_BYTES + _SIG_LEN
DEFAULT_MAX_SKEW_S = 120.0
"""Clock window: wide enough for unsynchronised volunteer clocks (NTP keeps them within seconds),
narrow enough that the replay guard only needs to remember two minutes of nonces."""


@dataclass(frozen=True)
class Opened:
    """A verified envelope: who signed what, when."""

    message: Message
    signer: str  # PeerID
    signer_public: bytes
    timestamp_ms: int
    nonce: bytes
    body: bytes
    raw: bytes
    """The whole envelope as received (what a store keeps: it stays verifiable)."""


def seal(key: NodeKey, run_id: str, message: Message, now: float | None = None) -> bytes:
    """Sign `message` for `run_id` with a fresh nonce; returns the wire bytes."""
    run = run_id.encode()
    if len(run) > 255:
        raise ValueError("run id longer than 255 bytes")
    body = encode_message(message)
    ts = int((time.time() if now is None else now) * 1000)
    unsigned = _HEAD.pack(MAGIC, FORMAT, key.public_bytes, ts, os.urandom(16), len(run)) + run
    unsigned += struct.pack(">I", len(body)) + body
    return unsigned + key.sign(_DOMAIN + unsigned)


def open_envelope(data: bytes, run_id: str, guard: "ReplayGuard | None" = None, now: float | None = None,
                  max_skew_s: float = DEFAULT_MAX_SKEW_S) -> Opened:
    """Verify and decode wire bytes; raises a typed `ProtocolError` on any failure."""
    signer, ts, nonce, run, body, unsigned, sig = _parse(data)
    verify(signer, _DOMAIN + unsigned, sig)  # raises InvalidSignature
    if run != run_id:
        raise WrongRun(f"envelope for run {run!r}, we serve {run_id!r}")
    now = time.time() if now is None else now
    if abs(ts / 1000.0 - now) > max_skew_s:
        raise ExpiredMessage(f"timestamp {ts / 1000.0:.3f} is {ts / 1000.0 - now:+.1f}s from now (window {max_skew_s}s)")
    message = decode_message(body)
    if guard is not None:  # after the body decodes: a malformed message must not burn its nonce
        guard.check_and_remember(signer, nonce, ts, now)
    return Opened(message, peer_id_from_public_bytes(signer), signer, ts, nonce, body, bytes(data))


def peek_signer(data: bytes) -> str:
    """PeerID an envelope claims (unverified): for logging who sent something we refuse."""
    try:
        return peer_id_from_public_bytes(_parse(data)[0])
    except Exception:
        return "?"


def _parse(data: bytes) -> tuple[bytes, int, bytes, str, bytes, bytes, bytes]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedMessage("envelope must be bytes")
    data = bytes(data)
    if len(data) > MAX_ENVELOPE_BYTES:
        raise MessageTooLarge(f"envelope of {len(data)} bytes exceeds {MAX_ENVELOPE_BYTES}")
    if len(data) < _HEAD.size + 4 + _SIG_LEN:
        raise MalformedMessage(f"envelope truncated ({len(data)} bytes)")
    magic, fmt, signer, ts, nonce, run_len = _HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        raise MalformedMessage("not an envelope (bad magic)")
    if fmt != FORMAT:
        raise MalformedMessage(f"envelope format {fmt} unsupported (we speak {FORMAT})")
    pos = _HEAD.size
    if len(data) < pos + run_len + 4 + _SIG_LEN:
        raise MalformedMessage("envelope truncated in run id")
    try:
        run = data[pos:pos + run_len].decode()
    except UnicodeDecodeError:
        raise MalformedMessage("run id is not UTF-8") from None
    pos += run_len
    (body_len,) = struct.unpack_from(">I", data, pos)
    pos += 4
    if body_len > MAX_BODY_BYTES:
        raise MessageTooLarge(f"body of {body_len} bytes exceeds {MAX_BODY_BYTES}")
    if len(data) != pos + body_len + _SIG_LEN:
        raise MalformedMessage(f"envelope length {len(data)} does not match its body length {body_len}")
    body = data[pos:pos + body_len]
    return signer, ts, nonce, run, body, data[:pos + body_len], data[pos + body_len:]


class ReplayGuard:
    """Remembers (signer, nonce) pairs for the freshness window; older ones are refused by time.

    Memory is bounded by `max_entries` (oldest dropped first); a dropped pair is older than any
    message still inside the window only if traffic exceeds max_entries per window, and then the
    oldest entries expire slightly early; that is the trade for a node that cannot be made to
    grow without bound.
    """

    def __init__(self, window_s: float = DEFAULT_MAX_SKEW_S, max_entries: int = 1_000_000):
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        self.durable = False
        """When set, new pairs are also kept for `drain` (a coordinator persists them: they survive a restart)."""
        self._new: list[tuple[bytes, float]] = []

    def check_and_remember(self, signer: bytes, nonce: bytes, timestamp_ms: int, now: float) -> None:
        self._expire(now)
        key = signer + nonce
        if key in self._seen:
            raise ReplayedMessage(f"nonce {nonce.hex()} from {peer_id_from_public_bytes(signer)} already seen")
        self._seen[key] = now
        if self.durable:
            self._new.append((key, now))
        if len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)

    def drain(self) -> list[tuple[bytes, float]]:
        """(key, seen at) of the pairs remembered since the last drain (only when `durable`)."""
        out, self._new = self._new, []
        return out

    def preload(self, entries: list[tuple[bytes, float]], now: float) -> None:
        """Remember pairs a previous incarnation saw (oldest first); those past the horizon are skipped."""
        for key, seen_at in sorted(entries, key=lambda e: e[1]):
            self._seen[key] = seen_at
        self._expire(now)

    @property
    def horizon_s(self) -> float:
        """How long a pair must be remembered: after that its timestamp alone refuses a replay."""
        return 2 * self.window_s

    def _expire(self, now: float) -> None:
        # A message stamped ts is refused by time once now > ts + window; it arrived no earlier
        # than ts - window, so 2 x window after arrival its replay is refused without the entry.
        horizon = now - 2 * self.window_s
        while self._seen:
            key, seen_at = next(iter(self._seen.items()))
            if seen_at >= horizon:
                break
            self._seen.popitem(last=False)

    def __len__(self) -> int:
        return len(self._seen)
