"""Relay: mirror a run's versions from upstream sources as they appear, and serve them onward.

Invariant: a relay serves only what it fetched and verified itself (it is a `Fetcher` into the
store its `ShardServer` serves), so a compromised upstream cannot make it relay bad bytes.
Versions are mirrored in ascending order, so every delta's parent is held before the delta and
downstream late joiners find the whole chain back to a keyframe.
"""

from __future__ import annotations

import asyncio
import logging

from shardcast.errors import ShardcastError
from shardcast.fetch import Fetcher

log = logging.getLogger(__name__)

DEFAULT_POLL_S = 2.0
"""How often upstream version lists are read; gossip announcements can wake the relay sooner."""
EAGER_POLL_S = 0.25
EAGER_FOR_S = 10.0
"""After a wake (an announcement) that found nothing new upstream, the lists are read every EAGER_POLL_S for
up to EAGER_FOR_S: a version is announced once listed beside its publisher, before its wire shards are on
its server (`shardcast.publish.publish_stream`: seconds for a 10 GB version)."""


async def mirror(fetcher: Fetcher, run_id: str, keep_last: int = 4, poll_s: float = DEFAULT_POLL_S,
                 stop: asyncio.Event | None = None, wake: asyncio.Event | None = None) -> None:
    """Fetch every new upstream version of `run_id` until `stop` is set; apply retention."""
    stop = stop or asyncio.Event()
    wake = wake or asyncio.Event()
    eager = 0  # fast rounds left after a wake
    while not stop.is_set():
        # A round can wait a long time (a source that vanished mid-version is given NO_HOLDER_TIMEOUT_S
        # to come back), so it runs as a task that a stop cancels: shutdown never waits on upstream.
        # Cancelling is safe: the store renames a shard into place only once verified.
        round_ = asyncio.ensure_future(_mirror_round(fetcher, run_id, keep_last, poll_s))
        try:
            await _first(stop, round_)
        finally:
            if not round_.done():
                round_.cancel()
                await asyncio.gather(round_, return_exceptions=True)
        if round_.cancelled():
            break
        if round_.result():  # an unexpected error still surfaces
            eager = 0  # mirrored what was announced
        wait = min(poll_s, EAGER_POLL_S) if eager > 0 else poll_s
        eager = max(0, eager - 1)
        try:
            await asyncio.wait_for(_first(stop, wake), wait)
        except asyncio.TimeoutError:
            pass
        if wake.is_set():
            eager = int(EAGER_FOR_S / EAGER_POLL_S)
        wake.clear()


def versions_to_mirror(upstream: list[int], held: list[int]) -> list[int]:
    """Upstream versions newer than the newest held, oldest first (parents before their deltas).
    Pure: the relay's mirror loop and the swarm simulator both decide with it."""
    newest_held = max(held, default=-1)
    return sorted(v for v in set(upstream) if v > newest_held)


async def _mirror_round(fetcher: Fetcher, run_id: str, keep_last: int, poll_s: float) -> int:
    """Versions mirrored this round."""
    mirrored = 0
    try:
        upstream = await fetcher.versions(run_id)
        for v in versions_to_mirror(upstream, fetcher.store.complete_versions(run_id)):
            await fetcher.fetch(run_id, v)
            log.info("relay: mirrored %s v%d", run_id, v)
            mirrored += 1
            fetcher.store.retain(run_id, keep_last)
    except ShardcastError as exc:
        # An upstream that lies or vanishes must not kill the relay; try again next round.
        log.warning("relay: %s; retrying in %.1fs", exc, poll_s)
    except OSError as exc:
        # A full (or failing) disk: keep serving what is held, try again next round
        # (found by benchmarks.chaos: the relay died on ENOSPC).
        log.warning("relay: cannot store %s: %s; retrying in %.1fs", run_id, exc, poll_s)
    return mirrored


async def _first(*waitables: asyncio.Event | asyncio.Future) -> None:
    """Return when any event is set or any future is done (futures passed in are not cancelled)."""
    waits = [asyncio.ensure_future(w.wait()) if isinstance(w, asyncio.Event) else w for w in waitables]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w, given in zip(waits, waitables):
            if w is not given:
                w.cancel()
