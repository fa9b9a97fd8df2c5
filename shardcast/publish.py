"""Publishing: a state dict becomes a signed, sharded, compressed version in a store.

A version is a delta against its parent when the parent's verified payload is held with an
identical tensor layout and fewer than `keyframe_every` versions have passed since the last
full version; otherwise it is a full keyframe. So a late joiner never replays more than
`keyframe_every - 1` deltas, and the retention policy keeps the keyframes that chain needs.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from protocol.identity import NodeKey
from shardcast.codec import DEFAULT_SHARD_SIZE, DEFAULT_ZSTD_LEVEL, element_size, encode_shard, flatten, shard_ranges
from shardcast.locks import held
from shardcast.hashing import content_hash
from shardcast.manifest import Manifest, ShardEntry, SignedManifest, TensorEntry
from shardcast.shard_map import shard_file
from shardcast.store import Store

log = logging.getLogger(__name__)


@dataclass
class PublishOptions:
    shard_size: int = DEFAULT_SHARD_SIZE
    zstd_level: int = DEFAULT_ZSTD_LEVEL
    keyframe_every: int = 8
    """A full version at least every K versions (K=1: never delta)."""
    keep_last: int = 4
    """Retention R: versions kept (plus the keyframe chain they need); must be >= k+1."""
    threads: int = field(default_factory=lambda: default_threads())
    """Shards compressed in parallel (zstd and blake3 release the GIL): three quarters of the host's
    cores, 2 to 16 (a 1 GB version took 4.2 s to publish on 2 threads of the 16-core H200 host; a 10 GB
    delta 4.4-12 s on 8, its threads' encoding 25-59 s and writes 9-48 s in all, session 9)."""
    sparse: bool = True
    """Delta shards may use the sparse encoding (changed words only) where it is smaller than XOR."""
    wire_nice: int = 10
    """Niceness added to the threads encoding a streamed version's wire shards (`publish_stream`'s step 2, once
    the version is announced): roles sharing this host and store already read it, and their work on it (an
    inference node staging it onto the GPU: the next step's critical path) and the trainer's next step come
    first; with nothing else to run, the encoding keeps every core it had. 0: the process's own priority.
    On the 16-core H200 host these 12 threads' ~25 s of encoding ran while the co-located node staged the same
    version (session 32: staging 1.7-2.5 s there, 0.8 s alone). Measured beside the staging alone (benchmarks.
    stage_speed, 1x H100, session 33): the encoding slowed it 1.33x at niceness 0 and 1.41x at +10 (two repeats
    each: no gain; memory bandwidth, not cores);
    the network's effect is not measured yet."""


def default_threads() -> int:
    return max(2, min(16, (os.cpu_count() or 2) * 3 // 4))


def lower_priority(nice: int) -> None:
    """The calling thread's niceness raised by `nice` (Linux schedules threads one by one; elsewhere, or where the
    kernel refuses, a no-op: the work runs at the process's priority, only later)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:
        log.debug("thread priority not lowered: %s", exc)


def shard_word(tensors: list[TensorEntry], start: int, stop: int) -> int:
    """Element size of the dtype covering most bytes of payload[start:stop] (the sparse word)."""
    by_size: dict[int, int] = {}
    for t in tensors:
        overlap = min(stop, t.offset + t.nbytes) - max(start, t.offset)
        if overlap > 0:
            size = element_size(t.dtype)
            by_size[size] = by_size.get(size, 0) + overlap
    return max(by_size, key=by_size.__getitem__, default=2)


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def publish(
    store: Store,
    key: NodeKey,
    run_id: str,
    version: int,
    state: dict[str, torch.Tensor],
    parent: int | None = None,
    options: PublishOptions | None = None,
) -> SignedManifest:
    """Write version `version` of `run_id` into `store`, signed by `key`; apply retention."""
    opt = options or PublishOptions()
    if opt.keyframe_every < 1:
        raise ValueError("keyframe_every must be >= 1")
    with held(store.lock(run_id, version)):  # another process of this host may share the store
        signed = _publish_locked(store, key, run_id, version, state, parent, opt)
    store.retain(run_id, opt.keep_last)
    return signed


def _publish_locked(store: Store, key: NodeKey, run_id: str, version: int, state: dict[str, torch.Tensor],
                    parent: int | None, opt: PublishOptions) -> SignedManifest:
    tensors, payload = flatten(state)
    parent, keyframe, encoding = _delta_parent(store, run_id, version, tensors, parent, opt)
    parent_payload = store.payload(run_id, parent) if parent is not None else None
    entries, _ = _encode_wire(store, run_id, version, tensors, payload, parent_payload, opt)
    manifest = Manifest(
        run_id=run_id,
        version=version,
        parent=parent,
        encoding=encoding,
        keyframe=keyframe,
        shard_size=opt.shard_size,
        total_bytes=len(payload),
        tensors=tensors,
        shards=entries,
    )
    signed = SignedManifest.sign(manifest, key)
    store.put_payload(run_id, version, payload)
    store.put_manifest(signed)  # last: a version is listed only once everything is in place
    log.info("published %s v%d (%s, %d shards, %.1f MiB raw -> %.1f MiB wire)", run_id, version, encoding,
             len(entries), len(payload) / 2**20, manifest.wire_bytes / 2**20)
    return signed


def publish_stream(
    store: Store,
    key: NodeKey,
    run_id: str,
    version: int,
    tensors: list,
    payload: np.ndarray,
    filled,
    parent: int | None = None,
    options: PublishOptions | None = None,
    on_signed=None,
    wire_after: Future | None = None,
    on_whole=None,
) -> SignedManifest:
    """`publish` for a payload that is still being written: `tensors` is its layout (`codec.layout`),
    `filled` yields increasing byte counts n (payload[:n] is final once n is yielded). In two steps:
    1. as soon as a shard's range is final, a pool thread hashes it and writes its raw bytes as the
       shard's file of the payload (`shardcast.shard_map`), so the copy into `payload` (e.g. device-to-
       host, tensor by tensor), the hashing and the writes overlap; then the version's local manifest
       (content only) is signed and written, and `on_signed(local)` is called: processes sharing this
       store read the version from here on (the coordinator can announce it: `manifest_hash` is the
       same for both manifests), and `payload` is no longer read;
    2. the wire shards are encoded from the stored payload (delta against the parent's, per
       `keyframe_every`), and the whole manifest is signed and listed: peers elsewhere fetch from then
       on (until then they are told the version is not here, and ask again).
    Encoding was most of a delta's publication (2.1-3.6 s of a 10 GB version on 12 threads of the H200
    host, session 15): it no longer stands between a step's end and its announcement. `wire_after`: the
    publisher's previous version's step 2 (its whole manifest's Future), which this one's step 2 waits for,
    done or failed: one version's wire shards are encoded at a time, in order, while the next version's step 1
    goes on beside them. `on_whole(signed)` is called once the whole manifest is listed, before retention (which
    deletes older versions' files: ~0.5 s for a 10 GB payload on tmpfs, nothing the next version waits for).
    Returns the whole SignedManifest after retention. Same store layout, delta/keyframe rule and signature as
    `publish`."""
    opt = options or PublishOptions()
    if opt.keyframe_every < 1:
        raise ValueError("keyframe_every must be >= 1")
    with held(store.lock(run_id, version)):
        local, parent = _list_content_locked(store, key, run_id, version, tensors, payload, filled, parent, opt)
    if on_signed is not None:
        on_signed(local)
    if wire_after is not None:
        wait([wire_after])
    signed = _publish_wire(store, key, local.manifest, opt)
    if on_whole is not None:
        on_whole(signed)
    store.retain(run_id, opt.keep_last)
    return signed


def _delta_parent(store: Store, run_id: str, version: int, tensors: list, parent: int | None,
                  opt: PublishOptions) -> tuple[int | None, int, str]:
    """(parent, keyframe, encoding) of a version: a delta where the parent's payload is held (whole or listed
    locally) with the same layout and the keyframe is recent enough, else a full version (parent None)."""
    if parent is None:
        return None, version, "full"
    pm = store.held_manifest(run_id, parent)
    if pm is None or not store.payload_path(run_id, parent).exists():
        log.warning("v%d: parent v%d not held; publishing a full version", version, parent)
        return None, version, "full"
    pm_ = pm.manifest
    if [t.model_dump() for t in pm_.tensors] != [t.model_dump() for t in tensors] or pm_.shard_size != opt.shard_size:
        log.warning("v%d: layout differs from parent v%d; publishing a full version", version, parent)
        return None, version, "full"
    if version - pm_.keyframe >= opt.keyframe_every:
        return None, version, "full"
    return parent, pm_.keyframe, "delta"


def _list_content_locked(store: Store, key: NodeKey, run_id: str, version: int, tensors: list, payload: np.ndarray,
                         filled, parent: int | None, opt: PublishOptions) -> tuple[SignedManifest, int | None]:
    """Step 1 of `publish_stream`, under the version's lock: the payload's shard files and raw hashes, then
    the signed local manifest. Returns it and the parent a delta is encoded against (None: full)."""
    parent, keyframe, encoding = _delta_parent(store, run_id, version, tensors, parent, opt)
    ranges = shard_ranges(len(payload), opt.shard_size)
    final = store.payload_dir(run_id, version)
    final.parent.mkdir(parents=True, exist_ok=True)
    # the raw bytes as one file per shard (`shardcast.shard_map`): each thread writes its own file, where
    # pwrites into one file serialised on its inode lock (3.5 GB/s at any thread count on the H200 host)
    tmp = final.with_name(f".{final.name}.{os.getpid()}-{threading.get_ident()}.stream.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    seconds, summing = {"hash": 0.0, "write": 0.0}, threading.Lock()  # over the pool's threads, for the log

    def one(i: int) -> ShardEntry:
        a, b = ranges[i]
        raw = payload[a:b]
        t0 = time.perf_counter()
        raw_hash = content_hash(memoryview(raw))
        t1 = time.perf_counter()
        with open(shard_file(tmp, i), "wb") as f:
            f.write(memoryview(raw))
        with summing:
            seconds["hash"] += t1 - t0
            seconds["write"] += time.perf_counter() - t1
        return ShardEntry(index=i, raw_size=b - a, raw_hash=raw_hash)

    t_start = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=max(1, opt.threads)) as pool:
            futures, submitted = [], 0
            for n in filled:  # if it raises, the pool's exit still waits for the writes in flight
                while submitted < len(ranges) and ranges[submitted][1] <= n:
                    futures.append(pool.submit(one, submitted))
                    submitted += 1
            t_filled = time.perf_counter()
            futures += [pool.submit(one, i) for i in range(submitted, len(ranges))]
            entries = [f.result() for f in futures]
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # published again (the same bytes): the old files go, a reader's mapping keeps its pages
        shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    manifest = Manifest(run_id=run_id, version=version, parent=parent, encoding=encoding, keyframe=keyframe,
                        shard_size=opt.shard_size, total_bytes=len(payload), tensors=tensors, shards=entries)
    local = SignedManifest.sign(manifest, key)
    store.put_local_manifest(local)
    log.info("listed %s v%d locally (%s, %d shards, %.1f MiB) in %.2f s: payload filled after %.2f s; hash %.1f s + "
             "write %.1f s over %d threads", run_id, version, encoding, len(entries), len(payload) / 2**20,
             time.perf_counter() - t_start, t_filled - t_start, seconds["hash"], seconds["write"], opt.threads)
    return local, parent


def _encode_wire(store: Store, run_id: str, version: int, tensors: list, payload: np.ndarray,
                 parent_payload: np.ndarray | None, opt: PublishOptions,
                 raw_hashes: list[str] | None = None,
                 behind: bool = False) -> tuple[list[ShardEntry], dict[str, float]]:
    """Every wire shard of `payload` (a delta against `parent_payload` when given) encoded on the pool and
    stored; their entries in order and the seconds the threads spent encoding and writing (`raw_hashes`:
    already known, not computed again; `behind`: written behind, `Store.put_shard`)."""
    ranges = shard_ranges(len(payload), opt.shard_size)
    seconds, summing = {"encode": 0.0, "write": 0.0}, threading.Lock()

    def one(i: int) -> ShardEntry:
        a, b = ranges[i]
        t0 = time.perf_counter()
        entry, wire = encode_shard(i, payload[a:b], None if parent_payload is None else np.asarray(parent_payload[a:b]),
                                   opt.zstd_level, word=shard_word(tensors, a, b), sparse=opt.sparse,
                                   raw_hash=None if raw_hashes is None else raw_hashes[i])
        t1 = time.perf_counter()
        store.put_shard(run_id, version, i, wire, behind=behind)
        with summing:
            seconds["encode"] += t1 - t0
            seconds["write"] += time.perf_counter() - t1
        return entry

    nice = opt.wire_nice if behind else 0  # behind: announced already, the host's other work first
    with ThreadPoolExecutor(max_workers=max(1, opt.threads), initializer=lower_priority, initargs=(nice,)) as pool:
        return list(pool.map(one, range(len(ranges)))), seconds


def _publish_wire(store: Store, key: NodeKey, local: Manifest, opt: PublishOptions) -> SignedManifest:
    """Step 2 of `publish_stream`: every wire shard encoded from the stored payload (the parent's too, for
    a delta: both mapped, so the caller's buffer is free), then the whole manifest signed and listed."""
    run_id, version = local.run_id, local.version
    parent_payload = store.payload(run_id, local.parent) if local.parent is not None else None
    t_start = time.perf_counter()
    entries, seconds = _encode_wire(store, run_id, version, local.tensors, store.payload(run_id, version),
                                    parent_payload, opt, [s.raw_hash for s in local.shards],
                                    behind=True)  # announced already: nobody on this host waits for them
    signed = SignedManifest.sign(local.with_wire(entries), key)
    store.put_manifest(signed)
    log.info("published %s v%d streamed (%s, %d shards, %.1f MiB raw -> %.1f MiB wire): wire shards in %.2f s after "
             "it was listed locally; encode %.1f s + write %.1f s over %d threads at niceness +%d", run_id, version,
             local.encoding, len(entries), local.total_bytes / 2**20, signed.manifest.wire_bytes / 2**20,
             time.perf_counter() - t_start, seconds["encode"], seconds["write"], opt.threads, opt.wire_nice)
    return signed
