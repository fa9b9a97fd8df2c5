"""The sources a fetcher may download from, how it picks among them, and what it does when a
download fails: a pure policy with an injected clock, driven by the real fetcher (`fetch.py`) and
by the swarm simulator (`benchmarks/swarm_sim.py`) alike, so the simulation runs this code.

A source is an origin, relay or peer base URL. Each carries a throughput estimate (EWMA of
bytes/s over its completed shards), how many downloads it has in flight, and which shards it
holds (unknown = assume all, as for an origin). Choice: the source with the highest estimated
throughput per in-flight download, among those that hold the shard and have not failed it;
an unmeasured source counts as fastest so every source gets measured once.
A source that sends bytes that fail a hash is dropped at once (it lied or is broken); one that
stalls or errors is dropped after `MAX_SOURCE_FAILURES`.
"""

from __future__ import annotations

import enum
from collections import Counter
from itertools import chain
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Callable

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
    busy_streak: int = 0
    """503s in a row from this source; its cooldown doubles with each (reset by a success)."""
    seed: bool = False
    """A super-seeding origin (its /have says so): lists only shards it still offers; asked for
    a hidden shard only as a last resort (`ShardSchedule.next`)."""

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
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    """Seconds, monotonic: wall time in a fetcher, simulated time in the swarm simulator."""
    rng: random.Random = field(default_factory=random.Random, repr=False)
    """Tie-breaks among equally rare shards."""

    @classmethod
    def of(cls, urls: list[str], clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> "SourcePool":
        seen, out = set(), []
        for u in urls:
            u = u.rstrip("/")
            if u not in seen:
                seen.add(u)
                out.append(Source(u))
        return cls(out, clock=clock, rng=rng or random.Random())

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
        now = self.clock()
        alive = self.alive()
        best: tuple[float, Source, set[int]] | None = None
        for s in alive:
            if s.inflight >= per_source or s.cooldown_until > now:
                continue
            held = pending if s.have is None else pending & s.have
            if not held:
                continue
            avail = {i for i in held if s.url not in self.excluded.get(i, ())} if self.excluded else held
            if not avail:
                # Every holder failed these shards once: allow a retry at a source that failed.
                avail = {i for i in held if all(h.url in self.excluded.get(i, ()) for h in alive if h.have is None or i in h.have)}
            if not avail:
                continue
            score = float("inf") if s.throughput is None else s.throughput / (s.inflight + 1)
            if best is None or score > best[0]:
                best = (score, s, avail)
        if best is None:
            return None
        _, src, avail = best
        # Holders + fetchers of each available shard among peers that said what they hold. A set
        # covering every candidate adds one to each, which cannot change the rarest: skipped.
        n = len(avail)
        counts = Counter(chain.from_iterable(x for p in alive if p.have is not None for x in (p.have & avail, p.fetching & avail) if len(x) < n))
        low = min(counts.get(i, 0) for i in avail)
        return src, self.rng.choice(sorted(i for i in avail if counts.get(i, 0) == low))

    def exclude(self, index: int, source: Source) -> None:
        self.excluded.setdefault(index, set()).add(source.url)


class Outcome(enum.Enum):
    """How one shard download ended, as the policy sees it."""

    BUSY = "busy"
    """503/429: out of upload slots. No penalty; short cooldown."""
    CORRUPT = "corrupt"
    """Bytes failed a hash (or a sparse delta was malformed): the source lied, never again."""
    TRUNCATED = "truncated"
    """Connection cut mid-shard: dropped for this version (a dying source may come back)."""
    NOT_FOUND = "not_found"
    """The source does not hold the shard (its holdings changed)."""
    UNAVAILABLE = "unavailable"
    """Refused, stalled or an HTTP error: a failure; MAX_SOURCE_FAILURES drop the source."""
    NOT_OFFERED = "not_offered"
    """425 from a super-seeding origin: handed out already; no penalty, get it from a peer."""


DEFAULT_MAX_ATTEMPTS = 6
"""Attempts per shard (across all sources) before the fetch fails."""
BUSY_BACKOFF_S = 0.25
"""Cooldown of a source after it refused a shard with 503; doubles per 503 in a row, up to
MAX_BUSY_BACKOFF_S (a relay 1,000 nodes want is busy for a while; asking every 0.25 s is a storm)."""
MAX_BUSY_BACKOFF_S = 4.0
MAX_BUSY_RETRIES = 400
"""503s tolerated per shard (~100 s of backoff plus the servers' queue waits) before giving up."""
NO_HOLDER_TIMEOUT_S = 30.0
"""Fail when, for this long, nothing was fetched and no live source holds or is fetching a missing
shard (the simulator found a node behind 16 relays failing a 60 GB fetch: its relays were still
pulling their first 512 MiB shards from a shared 1 Gbit/s origin after 30 s)."""
STARVE_S = 1.0
"""Seconds with nothing in flight, nothing any source offers and nothing it needs being fetched
by a source before a fetcher asks a super-seeding origin for a hidden shard (its copy went to a
node that left, say)."""
DEFAULT_PER_SOURCE = 2
"""Downloads at once from one source when there are several: leaves the others' slots to peers,
so simultaneous clients pull different shards from a thin origin and trade them."""


@dataclass
class ShardSchedule:
    """Which shards of one version are still wanted, in flight, or failed, and the failure policy.
    Call `next()` when a download slot is free, then `succeeded` or `failed` with its outcome."""

    pool: SourcePool
    pending: set[int]
    parallel: int
    """Download slots; also the per-source cap when there is a single source."""
    per_source: int = DEFAULT_PER_SOURCE
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    inflight: set[int] = field(default_factory=set)
    """Shards being downloaded now (advertised in /have, so peers avoid duplicating us)."""
    attempts: dict[int, int] = field(default_factory=dict)
    busy: dict[int, int] = field(default_factory=dict)
    last_error: dict[int, str] = field(default_factory=dict)
    error: str | None = None
    """Why the fetch failed, once it has; None while it may still succeed."""
    starving_since: float | None = None
    """When the fetcher last found nothing to fetch with nothing in flight (None: not starving)."""
    starved: bool = False
    """Starved for STARVE_S: asking seeds for hidden shards until some source offers one again."""

    def __post_init__(self) -> None:
        self.remaining = len(self.pending)
        self.last_progress = self.pool.clock()

    @property
    def done(self) -> bool:
        return self.remaining == 0 or self.error is not None

    def next(self) -> tuple[Source, int, bool] | None:
        """Take the next (source, shard, last_resort), or None (wait: a peer may gain it, a slot
        may free up). `last_resort`: ask a super-seeding origin for a shard it hides, because
        nothing else has been fetchable for STARVE_S. Sets `error` when no source is left or none
        has held a missing shard for too long."""
        if self.done:
            return None
        cap = self.per_source if len(self.pool.alive()) > 1 else self.parallel
        pair = self.pool.pick(self.pending, cap)
        last_resort = False
        if pair is None:
            pair = self._starving(cap)
            if pair is None:
                if not self.pool.alive():
                    self.error = f"every source dropped; last errors: {self.summary()}"
                elif self.pending and not self.inflight and any(s.fetching & self.pending for s in self.pool.alive()):
                    self.last_progress = self.pool.clock()  # a source is fetching what we need: not stuck
                elif self.pending and not self.inflight and self.pool.clock() - self.last_progress > NO_HOLDER_TIMEOUT_S:
                    self.error = f"no live source holds shards {sorted(self.pending)[:8]}; {self.summary()}"
                return None
            last_resort = True
        else:
            self.starving_since, self.starved = None, False
        src, i = pair
        self.pending.discard(i)
        self.inflight.add(i)
        src.inflight += 1
        return src, i, last_resort

    def _starving(self, cap: int) -> tuple[Source, int] | None:
        if not self.pending:
            return None
        now = self.pool.clock()
        if not self.starved:
            # Not starving while we or a source we know are fetching a shard we need: wait for it.
            if self.inflight or any(s.fetching & self.pending for s in self.pool.alive()):
                self.starving_since = None
                return None
            if self.starving_since is None:
                self.starving_since = now
            if now - self.starving_since < STARVE_S:
                return None
            self.starved = True  # until a source offers something again: fill every slot this way
        seeds = [s for s in self.pool.alive() if s.seed and s.inflight < cap and s.cooldown_until <= now]
        if not seeds:
            return None
        return seeds[0], self.pool.rng.choice(sorted(self.pending))

    def succeeded(self, src: Source, i: int, nbytes: int, seconds: float) -> None:
        """Shard `i` arrived from `src` in `seconds` and passed both hashes."""
        src.inflight -= 1
        src.busy_streak = 0
        src.record(nbytes, seconds)
        self.inflight.discard(i)
        self.remaining -= 1
        self.last_progress = self.pool.clock()

    def failed(self, src: Source, i: int, outcome: Outcome, reason: str) -> None:
        """Shard `i` from `src` ended in `outcome`: penalise the source and put the shard back."""
        src.inflight -= 1
        self.inflight.discard(i)
        self.pending.add(i)
        if outcome is Outcome.NOT_OFFERED:
            if src.have is not None:
                src.have.discard(i)
            return
        if outcome is Outcome.BUSY:
            # Busy is not broken: no penalty; back off (bounded) and pick again.
            self.busy[i] = self.busy.get(i, 0) + 1
            if self.busy[i] > MAX_BUSY_RETRIES:
                self.error = f"shard {i}: every source stayed busy"
            src.cooldown_until = self.pool.clock() + min(MAX_BUSY_BACKOFF_S, BUSY_BACKOFF_S * 2**src.busy_streak)
            src.busy_streak += 1
            return
        self.last_error[i] = f"{src.url}: {reason}"
        self.pool.exclude(i, src)
        if outcome in (Outcome.CORRUPT, Outcome.TRUNCATED):
            # A cut connection (dying source) may come back for the next version; bytes that
            # fail a hash never will.
            src.drop(reason, lied=outcome is Outcome.CORRUPT)
        elif outcome is Outcome.NOT_FOUND:
            if src.have is not None:
                src.have.discard(i)
            else:
                src.have = set()
        else:
            src.fail(reason)
        self.attempts[i] = self.attempts.get(i, 0) + 1
        if self.attempts[i] >= self.max_attempts:
            self.error = f"shard {i} failed {self.attempts[i]} times; last: {self.last_error[i]}"

    def release(self, src: Source, i: int) -> None:
        """Put shard `i` back without judging `src` (the download was cancelled locally)."""
        src.inflight -= 1
        self.inflight.discard(i)
        self.pending.add(i)

    def summary(self) -> str:
        return "; ".join(f"shard {i}: {e}" for i, e in list(self.last_error.items())[:3]) or "none"
