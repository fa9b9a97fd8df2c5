"""What a store keeps of a run: versions by count, decoded payloads by count, and all of it by bytes.

Rules, in order:
1. The newest `keep_last` versions stay, with every parent a kept delta needs back to its keyframe
   (a late joiner rebuilds any kept version from what is held).
2. A version's decoded payload (`payload.bin` or `payload.d/`, as large as the model) stays only for the newest
   `keep_payloads` versions: older versions keep their wire shards, which peers are served from and
   which a fetch decodes again if a local process asks for that version later. The newest payload
   always stays: the next delta (published or fetched) is decoded against it.
3. With a byte budget (`max_bytes`), while the run's files take more than it: payloads other than
   the newest go first, then the oldest versions, never the newest nor the chain it needs.
4. A version listed only locally (its publication's second step, the wire shards, raised) and older than
   the newest whole version is stranded: the publisher has moved on and never finishes it. It goes like
   any version outside rule 1 (a kept delta built on it keeps it). A local-only version newer than every
   whole one may be in its second step now, and stays.
Invariant: nothing a process holds the version lock of (a fetch or publish in flight) is deleted;
retention skips it and a later pass takes it. Deleting a version renames its directory away first,
so another process sees a version whole or not at all.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
from typing import TYPE_CHECKING

from shardcast.locks import lock_path, try_exclusive

if TYPE_CHECKING:
    from shardcast.store import Store

log = logging.getLogger("shardcast.store")
_trash_seq = itertools.count()


def needed_by(store: Store, run_id: str, versions: set[int]) -> set[int]:
    """`versions` and every parent their delta chains need."""
    keep = set(versions)
    for v in list(keep):
        m = store.manifest(run_id, v)
        while m is not None and m.manifest.parent is not None and m.manifest.encoding == "delta":
            keep.add(m.manifest.parent)
            m = store.manifest(run_id, m.manifest.parent)
    return keep


def run_bytes(store: Store, run_id: str) -> int:
    """Disk blocks under the run's directories, its payloads' too where they lie elsewhere (a sparse partial
    payload counts what it holds; a file hard-linked twice counts once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    roots = [store.root] + ([store.payload_root] if store.payload_root is not None else [])
    for dirpath, _, files in (w for r in roots for w in os.walk(r / run_id)):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def delete_version(store: Store, run_id: str, version: int) -> bool:
    """Delete a version unless its lock is held; whether it went."""
    with try_exclusive(lock_path(store.root, run_id, version)) as got:
        if not got:
            return False
        src = store.version_dir(run_id, version)
        trash = store.root / run_id / f".trash.{os.getpid()}-{next(_trash_seq)}"
        if store.payload_root is not None:  # the payload first: a version is never left without its shards
            shutil.rmtree(store.payload_home(run_id, version), ignore_errors=True)
        try:
            os.replace(src, trash)
        except FileNotFoundError:
            return True  # another process's retention took it
        shutil.rmtree(trash, ignore_errors=True)
        return True


def drop_payload(store: Store, run_id: str, version: int) -> bool:
    """Delete a version's decoded payload, keeping its wire shards (only when all of them are held)."""
    m = store.manifest(run_id, version)
    path = store.payload_path(run_id, version)
    if m is None or not path.exists() or len(store.held_shards(run_id, version)) < len(m.manifest.shards):
        return False
    with try_exclusive(lock_path(store.root, run_id, version)) as got:
        if not got:
            return False
        if path.is_dir():  # a publisher's, one file per shard
            shutil.rmtree(path, ignore_errors=True)  # a process that mapped them keeps reading their pages
        else:
            path.unlink(missing_ok=True)  # a process that mapped it keeps reading its pages
        return True


def stranded(store: Store, run_id: str, held: list[int]) -> list[int]:
    """Rule 4's versions: a local manifest, no whole one, older than the newest of `held` (the whole versions)."""
    if not held:
        return []
    out = []
    for p in (store.root / run_id).iterdir():
        if p.name.isdigit() and int(p.name) < held[-1] and not (p / "manifest.json").exists() \
                and (p / "manifest.local.json").exists():
            out.append(int(p.name))
    return out


def retain(store: Store, run_id: str, keep_last: int) -> list[int]:
    """Apply the rules above; the versions deleted (payload drops are logged, not returned)."""
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    held = store.versions(run_id)
    keep = needed_by(store, run_id, set(held[-keep_last:]))
    doomed = [v for v in sorted(held + stranded(store, run_id, held))
              if v not in keep and delete_version(store, run_id, v)]
    kept = [v for v in held if v not in doomed]
    with_payload = [v for v in kept if store.payload_path(run_id, v).exists()]
    dropped = [v for v in with_payload[: max(0, len(with_payload) - max(1, store.keep_payloads))]
               if drop_payload(store, run_id, v)]
    if store.max_bytes is not None and run_bytes(store, run_id) > store.max_bytes:
        extra, more = _over_budget(store, run_id, kept, with_payload[-1:])
        dropped, doomed = dropped + extra, doomed + more
        kept = [v for v in kept if v not in more]
    if doomed:  # one line: a delta chain's base going frees 8 versions at once
        log.info("retention: deleted %s %s", run_id, ", ".join(f"v{v}" for v in doomed))
    if dropped:
        log.info("retention: %s payloads of %s dropped (wire shards kept)", run_id, ", ".join(f"v{v}" for v in dropped))
    return doomed


def _over_budget(store: Store, run_id: str, kept: list[int], newest_payload: list[int]) -> tuple[list[int], list[int]]:
    """Rule 3: payloads first, then the oldest versions, until the run fits `max_bytes`."""
    dropped = [v for v in kept if v not in newest_payload and store.payload_path(run_id, v).exists()
               and drop_payload(store, run_id, v)]
    doomed: list[int] = []
    essential = needed_by(store, run_id, set(kept[-1:]))
    for v in kept:  # oldest first; a version goes with every kept delta built on it (no broken chains)
        if run_bytes(store, run_id) <= store.max_bytes:  # type: ignore[operator]
            break
        if v in essential or v in doomed:
            continue
        for w in [w for w in kept if w not in doomed and v in needed_by(store, run_id, {w})]:
            if delete_version(store, run_id, w):
                doomed.append(w)
    if doomed:
        log.warning("retention: %s over its budget of %.2f GiB: versions %s deleted early", run_id,
                    store.max_bytes / 2**30, ", ".join(f"v{v}" for v in doomed))  # type: ignore[operator]
    return dropped, doomed
