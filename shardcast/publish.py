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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from protocol.identity import NodeKey
from shardcast.codec import DEFAULT_SHARD_SIZE, DEFAULT_ZSTD_LEVEL, element_size, encode_shard, flatten, shard_ranges
from shardcast.locks import held
from shardcast.manifest import Manifest, SignedManifest, TensorEntry
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


def default_threads() -> int:
    return max(2, min(16, (os.cpu_count() or 2) * 3 // 4))


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
    parent_payload, keyframe, encoding = None, version, "full"
    if parent is not None:
        pm = store.manifest(run_id, parent)
        if pm is not None and store.payload_path(run_id, parent).exists():
            pm_ = pm.manifest
            same_layout = [t.model_dump() for t in pm_.tensors] == [t.model_dump() for t in tensors] and pm_.shard_size == opt.shard_size
            if same_layout and version - pm_.keyframe < opt.keyframe_every:
                parent_payload, keyframe, encoding = store.payload(run_id, parent), pm_.keyframe, "delta"
            elif not same_layout:
                log.warning("v%d: layout differs from parent v%d; publishing a full version", version, parent)
        else:
            log.warning("v%d: parent v%d not held; publishing a full version", version, parent)

    ranges = shard_ranges(len(payload), opt.shard_size)

    def one(i: int):
        a, b = ranges[i]
        return encode_shard(i, payload[a:b], None if parent_payload is None else np.asarray(parent_payload[a:b]), opt.zstd_level,
                            word=shard_word(tensors, a, b), sparse=opt.sparse)

    with ThreadPoolExecutor(max_workers=max(1, opt.threads)) as pool:
        entries = []
        for entry, wire in pool.map(one, range(len(ranges))):
            store.put_shard(run_id, version, entry.index, wire)
            entries.append(entry)
    manifest = Manifest(
        run_id=run_id,
        version=version,
        parent=parent if encoding == "delta" else None,
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
) -> SignedManifest:
    """`publish` for a payload that is still being written: `tensors` is its layout
    (`codec.layout`), `filled` yields increasing byte counts n (payload[:n] is final once n is
    yielded). As soon as a shard's range is final, a pool thread compresses and hashes it and
    writes its raw bytes into the payload file at their offset (`os.pwrite`: the file is written
    by every thread at once, not by one), so the copy into `payload` (e.g. device-to-host, tensor
    by tensor), the encoding and the payload file all overlap. `on_signed(signed)` is called as
    soon as the version is listed, before retention deletes old versions. Same store layout,
    delta/keyframe rule, signature and retention as `publish`."""
    opt = options or PublishOptions()
    if opt.keyframe_every < 1:
        raise ValueError("keyframe_every must be >= 1")
    with held(store.lock(run_id, version)):
        signed = _publish_stream_locked(store, key, run_id, version, tensors, payload, filled, parent, opt)
    if on_signed is not None:
        on_signed(signed)
    store.retain(run_id, opt.keep_last)
    return signed


def _publish_stream_locked(store: Store, key: NodeKey, run_id: str, version: int, tensors: list, payload: np.ndarray,
                           filled, parent: int | None, opt: PublishOptions) -> SignedManifest:
    parent_payload, keyframe, encoding = None, version, "full"
    if parent is not None:
        pm = store.manifest(run_id, parent)
        if pm is not None and store.payload_path(run_id, parent).exists():
            pm_ = pm.manifest
            same_layout = [t.model_dump() for t in pm_.tensors] == [t.model_dump() for t in tensors] and pm_.shard_size == opt.shard_size
            if same_layout and version - pm_.keyframe < opt.keyframe_every:
                parent_payload, keyframe, encoding = store.payload(run_id, parent), pm_.keyframe, "delta"
    ranges = shard_ranges(len(payload), opt.shard_size)
    final = store.payload_dir(run_id, version)
    final.parent.mkdir(parents=True, exist_ok=True)
    # the raw bytes as one file per shard (`shardcast.shard_map`): each thread writes its own file, where
    # pwrites into one file serialised on its inode lock (3.5 GB/s at any thread count on the H200 host)
    tmp = final.with_name(f".{final.name}.{os.getpid()}-{threading.get_ident()}.stream.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()

    seconds, summing = {"encode": 0.0, "write": 0.0}, threading.Lock()  # over the pool's threads, for the log

    def one(i: int):
        a, b = ranges[i]
        raw = payload[a:b]
        t0 = time.perf_counter()
        entry, wire = encode_shard(i, raw, None if parent_payload is None else np.asarray(parent_payload[a:b]), opt.zstd_level,
                                   word=shard_word(tensors, a, b), sparse=opt.sparse)
        t1 = time.perf_counter()
        store.put_shard(run_id, version, i, wire)
        with open(shard_file(tmp, i), "wb") as f:
            f.write(memoryview(raw))
        with summing:
            seconds["encode"] += t1 - t0
            seconds["write"] += time.perf_counter() - t1
        return entry

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
    manifest = Manifest(run_id=run_id, version=version, parent=parent if encoding == "delta" else None,
                        encoding=encoding, keyframe=keyframe, shard_size=opt.shard_size, total_bytes=len(payload),
                        tensors=tensors, shards=entries)
    signed = SignedManifest.sign(manifest, key)
    store.put_manifest(signed)
    log.info("published %s v%d streamed (%s, %d shards, %.1f MiB raw -> %.1f MiB wire) in %.2f s: payload filled "
             "after %.2f s; encode %.1f s + write %.1f s over %d threads", run_id, version, encoding, len(entries),
             len(payload) / 2**20, manifest.wire_bytes / 2**20, time.perf_counter() - t_start, t_filled - t_start,
             seconds["encode"], seconds["write"], opt.threads)
    return signed
