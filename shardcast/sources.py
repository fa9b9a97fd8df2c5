"""The sources a fetcher may download from, and how it picks among them.

A source is an origin, relay or peer base URL. Each carries a throughput estimate (EWMA of
bytes/s over its completed shards), how many downloads it has in flight, and which shards it
holds (unknown = assume all, as for an origin). Choice: the source with the highest estimated
throughput per in-flight download, among those that hold the shard and have not failed it;
an unmeasured source counts as fastest so every source gets measured once.
A source that sends bytes that fail a hash is dropped at once (it lied or is broken); one that
stalls or errors is dropped after `MAX_SOURCE_FAILURES`.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

MAX_SOURCE_FAILURES = 2
"""Stalls/errors before a source is dropped: one may be a transient hiccup, two is a pattern."""
EWMA_ALPHA = 0.5
"""Weight of the newest shard's throughput: shards are large, so each sample is informative."""


@dataclass
class Source:
    url: str
    throughput: float | None = None
    """Bytes/s, EWMA over completed shards; None until measured."""
    inflight: int = 0
    failures: int = 0
    dropped: str | None = None
    """Why the source was dropped, or None while usable."""
    have: set[int] | None = None
    """Shard indices held for the version being fetched; None = unknown (assume all)."""
    bytes_received: int = 0
    fetching: set[int] = field(default_factory=set)
    """Shards the source (a peer) is downloading itself right now."""
    cooldown_until: float = 0.0
    """time.monotonic() before which the source is not asked again (it answered 503)."""
    lied: bool = False
    """It sent bytes or a manifest that failed verification: never used again."""

    def record(self, nbytes: int, seconds: float) -> None:
        rate = nbytes / max(seconds, 1e-6)
        self.throughput = rate if self.throughput is None else EWMA_ALPHA * rate + (1 - EWMA_ALPHA) * self.throughput
        self.bytes_received += nbytes

    def drop(self, reason: str, lied: bool = False) -> None:
        if self.dropped is None:
            self.dropped = reason
            self.lied = self.lied or lied
            log.warning("dropping source %s: %s", self.url, reason)

    def fail(self, reason: str) -> None:
        self.failures += 1
        log.info("source %s failed (%d/%d): %s", self.url, self.failures, MAX_SOURCE_FAILURES, reason)
        if self.failures >= MAX_SOURCE_FAILURES:
            self.drop(f"{self.failures} failures, last: {reason}")


@dataclass
class SourcePool:
    sources: list[Source]
    excluded: dict[int, set[str]] = field(default_factory=dict)
    """Per shard: sources that already failed it (tried elsewhere first)."""

    @classmethod
    def of(cls, urls: list[str]) -> "SourcePool":
        seen, out = set(), []
        for u in urls:
            u = u.rstrip("/")
            if u not in seen:
                seen.add(u)
                out.append(Source(u))
        return cls(out)

    def new_version(self) -> None:
        """Before each version: forget per-shard exclusions and holdings, and give sources
        dropped for stalls or errors another chance (a relay runs for days); liars stay out."""
        self.excluded.clear()
        for s in self.sources:
            s.have, s.fetching = None, set()
            if s.dropped is not None and not s.lied:
                s.dropped, s.failures = None, 0

    def alive(self) -> list[Source]:
        return [s for s in self.sources if s.dropped is None]

    def pick(self, pending: set[int], per_source: int) -> tuple[Source, int] | None:
        """The next (source, shard) to download, or None if no source may take one now.

        Source: highest throughput per in-flight download among those under `per_source`
        downloads, not cooling down after a 503, holding a pending shard. Shard: among those
        the source holds, the one fewest peers hold or are fetching (rarest first), so clients
        that start together pull different shards from the origin and then trade them."""
        now = time.monotonic()
        best: tuple[float, Source, list[int]] | None = None
        for s in self.alive():
            if s.inflight >= per_source or s.cooldown_until > now:
                continue
            avail = [i for i in (pending if s.have is None else pending & s.have) if s.url not in self.excluded.get(i, ())]
            if not avail:
                # Every holder failed these shards once: allow a retry at a source that failed.
                avail = [i for i in (pending if s.have is None else pending & s.have)
                         if all(h.url in self.excluded.get(i, ()) for h in self.alive() if h.have is None or i in h.have)]
            if not avail:
                continue
            score = float("inf") if s.throughput is None else s.throughput / (s.inflight + 1)
            if best is None or score > best[0]:
                best = (score, s, avail)
        if best is None:
            return None
        _, src, avail = best
        peers = [s for s in self.alive() if s.have is not None]
        rarity = {i: sum((i in p.have) + (i in p.fetching) for p in peers) for i in avail}  # type: ignore[operator]
        low = min(rarity.values())
        return src, random.choice([i for i in avail if rarity[i] == low])

    def exclude(self, index: int, source: Source) -> None:
        self.excluded.setdefault(index, set()).add(source.url)
