"""One shard's download: exactly its wire bytes from one source, into a reused buffer, or a typed
error the fetch policy (`sources.ShardSchedule`) knows what to do with (`outcome_of`)."""

from __future__ import annotations

import asyncio

import aiohttp

from shardcast.errors import (CorruptShard, NotOffered, ShardcastError, SourceBusy, SourceUnavailable, TruncatedShard,
                              VersionNotFound)
from shardcast.manifest import Manifest
from shardcast.sources import Outcome, Source


async def download_shard(session: aiohttp.ClientSession, src: Source, m: Manifest, i: int, last_resort: bool = False, *,
                         into: bytearray | None = None) -> memoryview:
    """Exactly shard `i`'s wire bytes from `src`, received into `into` (a reused buffer of at
    least the shard's wire size; a new one if None); a view of them. Typed errors otherwise."""
    entry = m.shards[i]
    buf = memoryview(into if into is not None else bytearray(entry.wire_size))[: entry.wire_size]
    try:
        query = "?last_resort=1" if last_resort else ""
        async with session.get(f"{src.url}/shardcast/{m.run_id}/{m.version}/shard/{i}{query}") as r:
            if r.status == 425:
                raise NotOffered(f"{src.url} handed shard {i} out already")
            if r.status == 404:
                raise VersionNotFound(f"shard {i} not held by {src.url}")
            if r.status in (429, 503):  # out of upload slots or over a rate limit: busy, not broken
                raise SourceBusy(f"{src.url} busy (HTTP {r.status})")
            if r.status != 200:
                raise SourceUnavailable(f"HTTP {r.status}")
            # Chunks as they arrive, copied once into the buffer (readexactly joins them twice
            # into a fresh allocation per shard).
            n = 0
            while n < entry.wire_size:
                chunk = await r.content.readany()
                if not chunk:
                    raise TruncatedShard(f"shard {i}: source sent {n} of {entry.wire_size} bytes")
                if n + len(chunk) > entry.wire_size:
                    raise CorruptShard(f"shard {i}: source sent more than {entry.wire_size} bytes")
                buf[n : n + len(chunk)] = chunk
                n += len(chunk)
            if not r.content.at_eof() and await r.content.read(1):
                raise CorruptShard(f"shard {i}: source sent more than {entry.wire_size} bytes")
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        raise TruncatedShard(f"shard {i}: connection cut: {exc}") from exc
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise SourceUnavailable(f"{type(exc).__name__}: {exc}") from exc
    return buf


def outcome_of(exc: ShardcastError) -> Outcome:
    """The policy's view of a failed download (`sources.ShardSchedule.failed`)."""
    if isinstance(exc, SourceBusy):
        return Outcome.BUSY
    if isinstance(exc, NotOffered):
        return Outcome.NOT_OFFERED
    if isinstance(exc, TruncatedShard):
        return Outcome.TRUNCATED
    if isinstance(exc, CorruptShard):
        return Outcome.CORRUPT
    if isinstance(exc, VersionNotFound):
        return Outcome.NOT_FOUND
    return Outcome.UNAVAILABLE
