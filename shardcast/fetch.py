"""Fetching a version from several sources at once into a store, verified shard by shard.

Invariant: no byte enters the store or the returned tensors unless it hashes to what a trusted
publisher's manifest says. A corrupt, truncated or stalled source costs a retry elsewhere, never
a wrong weight; a fetch either returns the exact published tensors or raises `FetchFailed`
naming the shards and the reasons. Shards already in the store (an interrupted earlier fetch)
are re-verified and reused, so a killed fetch resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
import numpy as np
from tqdm import tqdm

from shardcast.changes import CHANGES_UP_TO, ChangedBytes, ChangeTally, payload_changes
from shardcast.codec import PayloadView, TensorBytes, check_wire, decode_shard, dtype_of, view_of
from shardcast.download import download_shard, outcome_of
from shardcast.errors import (CorruptShard, FetchFailed, InvalidManifest, InvalidSignature, ShardcastError, SourceUnavailable,
                              UnknownPublisher, VersionNotFound)
from shardcast.locks import held_async
from shardcast.manifest import Manifest, SignedManifest, TensorEntry, TrustedPublishers
from shardcast.sources import DEFAULT_MAX_ATTEMPTS, DEFAULT_PER_SOURCE, ShardSchedule, Source, SourcePool
from shardcast.store import PartialPayload, PayloadFiles, Store

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULT_PARALLEL = min(8, max(4, os.cpu_count() or 1))
"""Shards downloaded at once: 4 overlap network, hashing and zstd on 2 cores; with more cores,
up to 8 decode in parallel (zstd and blake3 release the GIL)."""
DEFAULT_STALL_TIMEOUT = 10.0
"""Seconds without a byte before a source counts as stalled."""
PICK_POLL_S = 0.05
"""How often an idle worker looks again for a (source, shard) it may take."""
HAVE_TIMEOUT_S = 2.0
"""A shard list is a few bytes; a source that takes longer is treated as holding nothing for now."""
HAVE_REFRESH_S = 0.25
"""Shortest time between two re-reads of the sources' shard lists (peers gain shards as they
fetch): the pace while a worker is idle for want of a holder."""
HAVE_REQUESTS_PER_S = 8.0
"""While every worker is busy, shard lists are re-read at about this many requests per second in
all (each source every len(sources) / 8 s, at least every `HAVE_REFRESH_S`). At a fixed 0.25 s,
N peers that list each other made 4 N^2 requests per second at ~0.5 ms of CPU each (client +
server, measured here): 256/s at N = 8 (6% of a 2-core host), 1,024/s at N = 16 (25%)."""


class PayloadTensors(Mapping):
    """A version's tensors over its payload's mapping (name -> tensor), each a view made when it is looked up (no
    copy; a 5.2B version's ~3,100 views made at once cost the fetching thread a few interpreter-lock round trips
    each, beside the engine's thread). `index`: name -> (shape, dtype), and `entries`: where each lies in `payload`,
    both from the manifest's table (nothing viewed): node/engine/weight_staging.py copies the mapping whole to a GPU
    and serves views of that copy. `files`: where that payload lies in the store, for an engine of its own process
    that maps it itself (vLLM) instead of being handed a copy, and `changes`: the bytes a delta changed in its
    parent (`ChangedBytes`), for a consumer holding that parent."""

    def __init__(self, entries: list[TensorEntry], payload: np.ndarray, files: PayloadFiles | None,
                 changes: ChangedBytes | None = None):
        self.entries = {e.name: e for e in entries}
        self.payload, self.files, self.changes = payload, files, changes
        self.index = {e.name: (tuple(e.shape), dtype_of(e.dtype)) for e in entries}
        self._base: torch.Tensor | None = None

    def base(self) -> torch.Tensor:
        """The whole payload as one uint8 tensor over the mapping (no copy)."""
        if self._base is None:
            import torch

            self._base = torch.from_numpy(self.payload)
        return self._base

    def __getitem__(self, name: str) -> torch.Tensor:
        return view_of(self.base(), self.entries[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


@dataclass
class FetchedVersion:
    manifest: Manifest
    payload: np.ndarray
    wire_bytes_downloaded: int
    stages_s: dict[str, float] = field(default_factory=dict)
    """Where this fetch's time went, summed over its workers (they overlap: seconds of work, not of wall):
    `download_s`, `verify_s` (wire hash), `decode_s` (zstd or sparse, XOR, raw hash), `write_s` (payload
    file and shard file), and `wall_s` (the fetch as a whole, its parent's excluded)."""
    files: PayloadFiles | None = None
    """The payload's files in the store (None: a payload held in memory only)."""
    changes: ChangedBytes | None = None
    """For a delta decoded here against its parent: the bytes that differ (None: not a delta, held already,
    or more changed than `CHANGES_UP_TO`)."""

    def tensors(self) -> PayloadTensors:
        """Tensors over the payload (no copy), keyed by parameter name, for `load_weights`."""
        return PayloadTensors(self.manifest.tensors, self.payload, self.files, self.changes)


class Fetcher:
    """Downloads versions of one run from a pool of sources into `store`."""

    def __init__(self, store: Store, sources: list[str], trusted: TrustedPublishers, *, parallel: int = DEFAULT_PARALLEL,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT, max_attempts: int = DEFAULT_MAX_ATTEMPTS, progress: bool = False,
                 per_source: int = DEFAULT_PER_SOURCE, offline: bool = False,
                 local: Callable[[Manifest], TensorBytes | None] | None = None):
        """`offline`: no sources; a fetch reads what the store holds (a version's payload, or its wire
        shards decoded again where retention dropped the payload) and fails on anything else.
        `local`: this member's own copy of a version, asked for (on a thread) when a delta's parent is not
        in the store: given the parent's verified manifest, the version's tensors once checked against
        that manifest's raw hashes, or None (then the parent is fetched). So version 0, which every
        member holds as its checkpoint, is not downloaded as the parent of version 1."""
        if not sources and not offline:
            raise ValueError("at least one source URL is required")
        self.store, self.trusted = store, trusted
        self.pool = SourcePool.of(sources)
        self.parallel, self.stall_timeout, self.max_attempts, self.progress = parallel, stall_timeout, max_attempts, progress
        self.per_source, self.local = per_source, local
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "Fetcher":
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.stall_timeout, sock_read=self.stall_timeout)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=64), auto_decompress=False)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()

    # -- small requests -------------------------------------------------------------------
    async def _get(self, src: Source, path: str) -> bytes:
        assert self._session is not None, "use `async with Fetcher(...)`"
        try:
            async with self._session.get(f"{src.url}/shardcast/{path}") as r:
                if r.status == 404:
                    raise VersionNotFound(f"{src.url}: {path} not found")
                if r.status != 200:
                    raise SourceUnavailable(f"{src.url}: HTTP {r.status} for {path}")
                return await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise SourceUnavailable(f"{src.url}: {type(exc).__name__}: {exc}") from exc

    async def versions(self, run_id: str) -> list[int]:
        """Complete versions held by any live source."""
        found: set[int] = set()
        for src in self.pool.alive():
            try:
                found.update(int(v) for v in json.loads(await self._get(src, f"{run_id}/versions"))["complete"])
            except (ShardcastError, ValueError, KeyError, TypeError) as exc:
                log.info("no version list from %s: %s", src.url, exc)
        return sorted(found)

    async def _refresh_have(self, run_id: str, version: int) -> None:
        async def one(src: Source) -> None:
            try:
                body = await asyncio.wait_for(self._get(src, f"{run_id}/{version}/have"), HAVE_TIMEOUT_S)
                doc = json.loads(body)
                src.have = {int(i) for i in doc["shards"]}
                src.fetching = {int(i) for i in doc.get("fetching", [])}
                src.seed = doc.get("seed") is True
            except (ShardcastError, ValueError, KeyError, TypeError, asyncio.TimeoutError):
                src.have = set()  # cannot tell: treat as holding nothing until the next refresh

        await asyncio.gather(*(one(s) for s in self.pool.alive()))

    async def manifest(self, run_id: str, version: int, wire: bool = False) -> Manifest:
        """The verified manifest: from the store if held (with `wire`, only a whole one: a local manifest
        lists no wire shards to fetch), else the first source with a valid, whole one."""
        held = self.store.manifest(run_id, version) if wire else self.store.held_manifest(run_id, version)
        if held is not None:
            return held.verified(self.trusted)
        errors: list[ShardcastError] = []
        for src in sorted(self.pool.alive(), key=lambda s: -(s.throughput or 0)):
            try:
                signed = SignedManifest.from_json(await self._get(src, f"{run_id}/{version}/manifest"))
                m = signed.verified(self.trusted)
                if (m.run_id, m.version) != (run_id, version):
                    raise InvalidManifest(f"asked for {run_id} v{version}, got {m.run_id} v{m.version}")
                if not m.wire_complete:  # a server serves only whole manifests (`Store.manifest`)
                    raise InvalidManifest(f"{run_id} v{version}: the served manifest lists no wire shards")
            except (InvalidSignature, UnknownPublisher, InvalidManifest) as exc:
                src.drop(f"bad manifest: {exc}", lied=True)
                errors.append(exc)
                continue
            except ShardcastError as exc:
                errors.append(exc)
                continue
            self.store.put_manifest(signed)
            return m
        trust_errors = [e for e in errors if not isinstance(e, (VersionNotFound, SourceUnavailable))]
        if trust_errors:
            raise trust_errors[0]
        raise VersionNotFound(f"{run_id} v{version}: no source has it ({'; '.join(map(str, errors)) or 'no live sources'})")

    # -- the fetch ------------------------------------------------------------------------
    async def fetch(self, run_id: str, version: int, manifest_hash: str | None = None,
                    changes_of: int | None = None) -> FetchedVersion:
        """Fetch (or reuse) `version`, and first its delta chain back to the keyframe.
        `manifest_hash` (from a gossip `PolicyAnnounce`) pins the exact manifest expected. `changes_of`: a version
        the caller holds (its newest): the result carries its bytes against that version's (`changes`) wherever
        the store holds both payloads in one layout, not only when it was decoded here as a delta of it."""
        got = await self._fetch(run_id, version, manifest_hash)
        m = got.manifest
        decoded_against = m.parent if got.stages_s and m.encoding == "delta" else None  # its changes were kept then
        if changes_of is not None and changes_of not in (version, decoded_against) and (
                got.changes is None or got.changes.parent != changes_of):
            got.changes = await self._changes_against(got, changes_of)
        return got

    async def _changes_against(self, got: FetchedVersion, base: int) -> ChangedBytes | None:
        """`got`'s bytes against version `base`'s, both held in the store (`payload_changes`), or None."""
        m = got.manifest
        if not self.store.payload_path(m.run_id, base).exists():
            return None
        async with held_async(self.store.lock(m.run_id, base), exclusive=False):  # retention waits; the mapping outlives it
            signed = self.store.held_manifest(m.run_id, base)
            if signed is None or not self.store.payload_path(m.run_id, base).exists():
                return None
            bm = signed.verified(self.trusted)
            if bm.tensors != m.tensors or bm.total_bytes != m.total_bytes:
                return None
            old = self.store.payload(m.run_id, base)
        t0 = time.perf_counter()
        changes = await asyncio.to_thread(payload_changes, base, m.tensors, old, got.payload, m.shard_size, self.parallel)
        log.info("%s v%d against v%d: %s in %.2f s", m.run_id, m.version, base,
                 f"{len(changes.positions)} bytes changed" if changes is not None else
                 f"more than {CHANGES_UP_TO:.2%} of the bytes changed", time.perf_counter() - t0)
        return changes

    async def _fetch(self, run_id: str, version: int, manifest_hash: str | None) -> FetchedVersion:
        held = await self._held(run_id, version, manifest_hash)
        if held is not None:
            return held
        m = await self.manifest(run_id, version, wire=True)
        _check_announced(m, manifest_hash)
        parent_payload = None
        if m.encoding == "delta":
            assert m.parent is not None
            parent_payload = await self._parent_payload(run_id, m.parent)  # before this version's lock: no cycles
        # One writer per version per host: a process sharing this store that fetches (or publishes) it
        # now holds the lock; once we have it, the version may be complete already.
        async with held_async(self.store.lock(run_id, version)):
            done = self._complete(run_id, version, manifest_hash)
            return done if done is not None else await self._fetch_shards(m, parent_payload)

    async def _parent_payload(self, run_id: str, version: int) -> np.ndarray | PayloadView:
        """A delta's parent: its payload in the store, else this member's own copy (`local`), else fetched."""
        if self.local is not None and not self.store.payload_path(run_id, version).exists():
            pm = await self.manifest(run_id, version)
            source = await asyncio.to_thread(self.local, pm)
            if source is not None:
                log.info("%s v%d: delta parent read from this member's own copy (%.1f MiB not downloaded)",
                         run_id, version, pm.wire_bytes / 2**20)
                return PayloadView(pm.tensors, pm.total_bytes, source)
        return (await self.fetch(run_id, version)).payload

    async def _held(self, run_id: str, version: int, manifest_hash: str | None) -> FetchedVersion | None:
        """The version's verified payload from the store, or None; opened under the shared lock
        (retention cannot delete it between the check and the mapping, and the mapping outlives it)."""
        if not self.store.payload_path(run_id, version).exists():
            return None
        async with held_async(self.store.lock(run_id, version), exclusive=False):
            return self._complete(run_id, version, manifest_hash)

    def _complete(self, run_id: str, version: int, manifest_hash: str | None) -> FetchedVersion | None:
        """Under the version's lock: its payload and verified manifest (whole or local) when both are held."""
        signed = self.store.held_manifest(run_id, version)
        if signed is None or not self.store.payload_path(run_id, version).exists():
            return None
        m = signed.verified(self.trusted)
        _check_announced(m, manifest_hash)
        return FetchedVersion(m, self.store.payload(run_id, version), 0, files=self.store.payload_files(m))

    async def _fetch_shards(self, m: Manifest, parent: np.ndarray | PayloadView | None) -> FetchedVersion:
        loop = asyncio.get_running_loop()
        self.pool.new_version()
        payload = self.store.open_partial_payload(m.run_id, m.version, m.total_bytes, m.shard_size)
        try:
            return await self._fetch_into(m, parent, payload, loop)
        except BaseException:
            payload.discard()
            raise

    async def _fetch_into(self, m: Manifest, parent: np.ndarray | PayloadView | None, payload: PartialPayload,
                          loop: asyncio.AbstractEventLoop) -> FetchedVersion:
        max_raw = max((e.raw_size for e in m.shards), default=0)
        max_wire = max((e.wire_size for e in m.shards), default=0)
        t_start, spent = time.perf_counter(), Counter()  # Counter updates of distinct keys: fine under the GIL
        tally = ChangeTally(m.total_bytes)  # the delta's changed bytes, as the decoding threads find them

        def verify_into_payload(i: int, wire: bytes | memoryview, scratch: np.ndarray) -> None:
            # Both hashes pass before the decoded range is written. Decoded into `scratch` (reused,
            # already paged in), then pwritten: no page faults on a fresh mapping, no allocation.
            e, start = m.shards[i], i * m.shard_size
            t0 = time.perf_counter()
            check_wire(e, wire)
            t1 = time.perf_counter()
            out = scratch[: e.raw_size]
            parent_raw = None if parent is None else np.asarray(parent[start : start + e.raw_size])
            decode_shard(e, wire, out, parent_raw)
            if parent_raw is not None:
                tally.compare(i, start, out, parent_raw)  # each shard is decoded once (its raw hash checked before)
            t2 = time.perf_counter()
            payload.write(start, out)
            spent["verify_s"] += t1 - t0
            spent["decode_s"] += t2 - t1
            spent["write_s"] += time.perf_counter() - t2

        def accept(i: int, wire: memoryview, scratch: np.ndarray) -> None:
            verify_into_payload(i, wire, scratch)
            t0 = time.perf_counter()
            self.store.put_shard(m.run_id, m.version, i, wire)  # verified: final name, served from now on
            spent["write_s"] += time.perf_counter() - t0

        def reuse(i: int, scratch: np.ndarray) -> bool:
            try:
                verify_into_payload(i, self.store.read_shard(m.run_id, m.version, i), scratch)
                return True
            except (OSError, CorruptShard):
                self.store.shard_path(m.run_id, m.version, i).unlink(missing_ok=True)
                return False

        held = [i for i in self.store.held_shards(m.run_id, m.version) if i < len(m.shards)]
        reused: set[int] = set()
        if held:
            scratch = np.empty(max_raw, dtype=np.uint8)
            reused = {i for i in held if await loop.run_in_executor(None, reuse, i, scratch)}
            del scratch
        if reused:
            log.info("%s v%d: resuming; %d of %d shards already held and verified", m.run_id, m.version, len(reused), len(m.shards))
        plan = ShardSchedule(self.pool, {i for i in range(len(m.shards)) if i not in reused}, self.parallel,
                             per_source=self.per_source, max_attempts=self.max_attempts)
        key = (m.run_id, m.version)
        self.store.fetching[key] = plan.inflight  # advertised in /have, so peers avoid duplicating us
        downloaded = 0
        bar = tqdm(total=sum(m.shards[i].wire_size for i in plan.pending), unit="B", unit_scale=True,
                   desc=f"{m.run_id} v{m.version}", disable=not self.progress)
        await self._refresh_have(m.run_id, m.version)

        wanted = asyncio.Event()
        """Set by a worker that found nothing to take: re-read the shard lists soon."""

        session = self._session
        assert session is not None, "use `async with Fetcher(...)`"

        async def worker() -> None:
            nonlocal downloaded
            # One receive and one decode buffer per worker, reused for every shard it takes.
            wire_buf, scratch = bytearray(max_wire), np.empty(max_raw, dtype=np.uint8)
            while not plan.done:
                pick = plan.next()
                if pick is None:
                    wanted.set()
                    await asyncio.sleep(PICK_POLL_S)  # a peer may get it, a slot may free up
                    continue
                src, i, last_resort = pick
                t0 = time.perf_counter()
                try:
                    wire = await download_shard(session, src, m, i, last_resort, into=wire_buf)
                    seconds = time.perf_counter() - t0
                    spent["download_s"] += seconds
                    await loop.run_in_executor(None, accept, i, wire, scratch)
                except ShardcastError as exc:
                    plan.failed(src, i, outcome_of(exc), str(exc))
                    continue
                except BaseException:
                    plan.release(src, i)  # cancelled (or a local error): no fault of the source
                    raise
                plan.succeeded(src, i, len(wire), seconds)
                downloaded += len(wire)
                bar.update(len(wire))

        async def refresh_forever() -> None:
            # Peers gain shards while we fetch; re-read who holds what so they become sources:
            # soon when a worker idles, on a request budget while all are busy.
            while True:
                await asyncio.sleep(HAVE_REFRESH_S)
                budget_s = len(self.pool.alive()) / HAVE_REQUESTS_PER_S
                if budget_s > HAVE_REFRESH_S and not wanted.is_set():
                    try:
                        await asyncio.wait_for(wanted.wait(), budget_s - HAVE_REFRESH_S)
                    except asyncio.TimeoutError:
                        pass
                wanted.clear()
                await self._refresh_have(m.run_id, m.version)

        refresher = asyncio.create_task(refresh_forever())
        try:
            await asyncio.gather(*(worker() for _ in range(max(1, min(self.parallel, plan.remaining)))))
        finally:
            refresher.cancel()
            self.store.fetching.pop(key, None)
            bar.close()
        if plan.error is not None:
            raise FetchFailed(f"{m.run_id} v{m.version}: {plan.error}")
        verified = await loop.run_in_executor(None, self.store.commit_partial_payload, m.run_id, m.version, payload)
        log.info("%s v%d verified: %.1f MiB downloaded from %s", m.run_id, m.version, downloaded / 2**20,
                 ", ".join(f"{s.url}={s.bytes_received / 2**20:.0f}MiB" for s in self.pool.sources))
        stages = {k: round(v, 4) for k, v in spent.items()}
        stages["wall_s"] = round(time.perf_counter() - t_start, 4)
        changes = None if parent is None else tally.changes(m.parent, m.tensors)
        return FetchedVersion(m, verified, downloaded, stages, files=self.store.payload_files(m), changes=changes)

def _check_announced(m: Manifest, manifest_hash: str | None) -> None:
    if manifest_hash is not None and m.manifest_hash() != manifest_hash:
        raise InvalidManifest(f"{m.run_id} v{m.version}: manifest hash {m.manifest_hash()[:16]}.. is not the announced {manifest_hash[:16]}..")


def read_held(store: Store, trusted: TrustedPublishers, run_id: str, version: int) -> FetchedVersion:
    """A version from the store alone, verified as any fetch (for tools and tests reading a store:
    a dropped payload is rebuilt from the held shards)."""
    async def go() -> FetchedVersion:
        async with Fetcher(store, [], trusted, offline=True) as f:
            return await f.fetch(run_id, version)

    return asyncio.run(go())


async def fetch_version(store: Store, sources: list[str], trusted: TrustedPublishers, run_id: str,
                        version: int | None = None, changes_of: int | None = None, **kw) -> FetchedVersion:
    """One-shot helper: fetch `version` (default: the newest any source holds); `changes_of` as `Fetcher.fetch`."""
    async with Fetcher(store, sources, trusted, **kw) as f:
        if version is None:
            held = await f.versions(run_id)
            if not held:
                raise VersionNotFound(f"no source holds any version of {run_id}")
            version = held[-1]
        return await f.fetch(run_id, version, changes_of=changes_of)
