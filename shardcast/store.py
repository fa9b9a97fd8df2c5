"""On-disk store of versions: what a node holds, serves, and decodes deltas against.

Layout: `<root>/<run_id>/<version:08d>/{manifest.json, shard_00000.zst, ..., payload.bin}`; a
publisher's payload is `payload.d/raw_00000.bin, ...` instead (one file per shard, read back as one
array: `shardcast.shard_map`).
Invariant: every file in the store was verified before it got its final name (written to a
temporary name, then renamed), so a server never serves a partial or unverified shard, and a
crashed fetch leaves only whole, verified shards behind to resume from. The payload (the
reconstructed full version) exists only once all raw hashes matched.

One store per host: every role of a machine (trainer, relay, inference nodes, validator) may open
the same root (`join --store`), so a version is held once. Writers of a version hold its lock
(`shardcast.locks`), a second process fetching the same version waits for the first and then finds
it complete; what is kept is `shardcast.retention`'s (versions, payloads, a byte budget).

Payloads elsewhere (`payload_root`, e.g. on tmpfs): a version's decoded payload is a cache (its wire shards,
kept on disk, rebuild it), as large as the model, and the trainer writes one a version; on the disk that
every role of one host shares, a 10 GB version's write-back held the coordinator's fsyncs 2.6-7.9 s and the
trainer's own publication up to 12 s (session 22's 5.2B runs on one H200). With a payload root, payloads
lie under `<payload_root>/<run_id>/<version:08d>/` instead; the root is recorded in the store
(`.payload_root`), so every process that opens the store finds them there.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardcast import retention
from shardcast.locks import lock_path
from shardcast.manifest import Manifest, SignedManifest
from shardcast.shard_map import map_shard_files, shard_file
from shardcast.write_behind import write_behind

log = logging.getLogger(__name__)

PAYLOAD_ROOT_FILE = ".payload_root"
"""In a store's root: where its payloads lie, when not beside the wire shards (`Store(payload_root=...)`)."""

DEFAULT_KEEP_PAYLOADS = 2
"""The newest version's payload (the next delta's parent) and one more, so a role one version behind
(k >= 1) loads it without decoding it again; older versions keep only their wire shards."""


def _atomic_write(path: Path, data: bytes | bytearray | memoryview, behind: bool = False) -> None:
    """`behind`: each piece's writeback started as it is written (`shardcast.write_behind`)."""
    # One temp name per call: two fetches of one version in one process (a role that fetches on
    # join and on the announcement) write the same shard from two threads at once.
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{next(_tmp_seq)}.tmp")
    try:
        with open(tmp, "wb") as f:
            write_behind(f, data) if behind else f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not stay full of our half-written temp files
        raise


@dataclass(frozen=True)
class PayloadFiles:
    """A held version's payload on this host, as a process of its own maps it (an engine in another
    interpreter: contrib/vllm's worker extension): `path` is `payload.d` (one file per shard, `shard_map`'s
    layout, `shard_sizes` bytes each) or `payload.bin` (one file, `shard_sizes` None); `tensors` are the
    manifest's entries (name, dtype, shape, offset, nbytes into the payload). Hold `lock` shared while the
    files are read: retention leaves a version alone while anyone holds it."""

    path: Path
    shard_sizes: list[int] | None
    tensors: list[dict]
    lock: Path


class Store:
    """Versions of one or more runs under a root directory."""

    def __init__(self, root: str | Path, keep_payloads: int = DEFAULT_KEEP_PAYLOADS, max_bytes: int | None = None,
                 payload_root: str | Path | None = None):
        """`payload_root`: where decoded payloads lie (module docstring), recorded in the store for every
        process that opens it; None: as recorded, else beside the wire shards. One that differs from the
        recorded one is refused (`ValueError`): two processes of a host would each miss the other's."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.payload_root = _payload_root(self.root, None if payload_root is None else Path(payload_root))
        """Where payloads lie (None: in each version's directory)."""
        self.keep_payloads = keep_payloads
        """Decoded payloads kept, newest first (at least 1: the next delta decodes against it)."""
        self.max_bytes = max_bytes
        """Byte budget of one run's files (None: versions and payloads by count only)."""
        self.fetching: dict[tuple[str, int], set[int]] = {}
        """In memory: shards a fetch in this process is downloading now (advertised to peers)."""

    def version_dir(self, run_id: str, version: int) -> Path:
        return self.root / run_id / f"{version:08d}"

    def shard_path(self, run_id: str, version: int, index: int) -> Path:
        return self.version_dir(run_id, version) / f"shard_{index:05d}.zst"

    def manifest_path(self, run_id: str, version: int) -> Path:
        return self.version_dir(run_id, version) / "manifest.json"

    def local_manifest_path(self, run_id: str, version: int) -> Path:
        """A version's local manifest (content, no wire fields: `shardcast.manifest`), written beside its
        payload before the wire shards; never served (peers get `manifest.json`, once it is whole)."""
        return self.version_dir(run_id, version) / "manifest.local.json"

    def payload_path(self, run_id: str, version: int) -> Path:
        """The version's payload: its directory of shard files where a publisher wrote one, else `payload.bin`."""
        d = self.payload_dir(run_id, version)
        return d if d.is_dir() else self.payload_home(run_id, version) / "payload.bin"

    def payload_dir(self, run_id: str, version: int) -> Path:
        """Where a publisher keeps the payload as one file per shard (`shardcast.shard_map`)."""
        return self.payload_home(run_id, version) / "payload.d"

    def payload_home(self, run_id: str, version: int) -> Path:
        """The directory a version's payload (and its partial files while fetched) lies in."""
        if self.payload_root is None:
            return self.version_dir(run_id, version)
        return self.payload_root / run_id / f"{version:08d}"

    def lock(self, run_id: str, version: int) -> Path:
        """The version's lock file (`shardcast.locks`)."""
        return lock_path(self.root, run_id, version)

    # -- writes (each atomic) -------------------------------------------------------------
    def put_manifest(self, signed: SignedManifest) -> None:
        m = signed.manifest
        self.version_dir(m.run_id, m.version).mkdir(parents=True, exist_ok=True)
        _atomic_write(self.manifest_path(m.run_id, m.version), signed.to_json())

    def put_local_manifest(self, signed: SignedManifest) -> None:
        m = signed.manifest
        self.version_dir(m.run_id, m.version).mkdir(parents=True, exist_ok=True)
        _atomic_write(self.local_manifest_path(m.run_id, m.version), signed.to_json())

    def put_shard(self, run_id: str, version: int, index: int, wire: bytes | bytearray | memoryview,
                  behind: bool = False) -> None:
        """`behind`: its writeback started as it is written (`shardcast.write_behind`): for wire shards
        nobody on this host waits for (a publisher's, once the version is announced: 7.7 GB for a full bf16
        5.2B version) on a disk a co-located coordinator fsyncs on. Not a fetch's (the pages would go to the
        disk at its pace while the fetch waits: the page cache absorbs them), not a payload (members wait for
        it, and it is a cache: `payload_root` keeps it off the disk)."""
        self.version_dir(run_id, version).mkdir(parents=True, exist_ok=True)
        _atomic_write(self.shard_path(run_id, version, index), wire, behind=behind)

    def put_payload(self, run_id: str, version: int, payload: np.ndarray) -> None:
        self.payload_home(run_id, version).mkdir(parents=True, exist_ok=True)
        _atomic_write(self.payload_path(run_id, version), memoryview(payload))

    def open_partial_payload(self, run_id: str, version: int, total: int,
                             shard_size: int | None = None) -> "PartialPayload":
        """What a fetch writes verified shard ranges into (`PartialPayload.write`): with `shard_size`, a
        directory of one file per shard (renamed to `payload.d`: a fetch's decode threads each write their
        own file, as a publisher's do), else one file (renamed to `payload.bin`); by
        `commit_partial_payload` once every raw hash matched."""
        self.version_dir(run_id, version).mkdir(parents=True, exist_ok=True)
        home = self.payload_home(run_id, version)
        home.mkdir(parents=True, exist_ok=True)
        for stale in home.glob(".payload.*.partial"):
            # Left by a killed or failed fetch (its shards are reused, not this). A partial still
            # open is another fetch of the same version in flight: deleting it made that fetch's
            # rename fail (found by benchmarks.chaos; tests/chaos/test_regressions.py).
            owner = stale.name.split(".")[2].split("-")[0]
            if str(stale) not in _live_partials and (owner == str(os.getpid()) or not _pid_alive(owner)):
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)
        _partial_seq[0] += 1
        path = home / f".payload.{os.getpid()}-{_partial_seq[0]}.partial"
        return PartialPayload(path, total, shard_size)

    def commit_partial_payload(self, run_id: str, version: int, partial: "PartialPayload") -> np.ndarray:
        """Give a fully verified partial payload its final name (atomic rename); the payload,
        memory-mapped copy-on-write. No fsync: it would wait for the disk; the page cache already
        makes the renamed files' content visible, and resume re-verifies shards, not these files."""
        partial.close()
        if partial.shard_size is None:
            os.replace(partial.path, self.payload_home(run_id, version) / "payload.bin")
        else:
            final = self.payload_dir(run_id, version)
            if final.exists():  # (none should: a complete version is not fetched again)
                shutil.rmtree(final, ignore_errors=True)
            os.replace(partial.path, final)
        return self.payload(run_id, version)

    # -- reads ------------------------------------------------------------------------------
    def runs(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def versions(self, run_id: str) -> list[int]:
        """Versions whose manifest we hold (possibly with only some shards)."""
        d = self.root / run_id
        if not d.is_dir():
            return []
        return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and (p / "manifest.json").exists())

    def complete_versions(self, run_id: str) -> list[int]:
        """Versions held whole: every verified wire shard (a fetch rebuilds the payload from them
        without the network if retention dropped it), or the verified payload itself."""
        out = []
        for v in self.versions(run_id):
            if self.payload_path(run_id, v).exists():
                out.append(v)
                continue
            m = self.manifest(run_id, v)
            if m is not None and len(self.held_shards(run_id, v)) >= len(m.manifest.shards):
                out.append(v)
        return out

    def disk_bytes(self, run_id: str) -> int:
        """Bytes the run's files take on disk (blocks; each file once)."""
        return retention.run_bytes(self, run_id)

    def manifest(self, run_id: str, version: int) -> SignedManifest | None:
        """The whole (wire) manifest: what peers are served and fetch with."""
        p = self.manifest_path(run_id, version)
        return SignedManifest.from_json(p.read_bytes()) if p.exists() else None

    def held_manifest(self, run_id: str, version: int) -> SignedManifest | None:
        """The whole manifest, else the local one (a version whose wire shards are still being encoded):
        what a process reading the payload from this store needs."""
        signed = self.manifest(run_id, version)
        if signed is not None:
            return signed
        p = self.local_manifest_path(run_id, version)
        try:
            return SignedManifest.from_json(p.read_bytes())
        except FileNotFoundError:
            return None

    def held_shards(self, run_id: str, version: int) -> list[int]:
        d = self.version_dir(run_id, version)
        if not d.is_dir():
            return []
        return sorted(int(p.name[6:11]) for p in d.iterdir() if p.name.startswith("shard_") and p.name.endswith(".zst"))

    def read_shard(self, run_id: str, version: int, index: int) -> bytes:
        return self.shard_path(run_id, version, index).read_bytes()

    def payload(self, run_id: str, version: int) -> np.ndarray:
        """The verified full payload, memory-mapped copy-on-write: reads share the page cache; a
        consumer that writes into its tensors gets private pages and never changes the file."""
        path = self.payload_path(run_id, version)
        if path.is_dir():
            files = sorted(path.glob("raw_*.bin"))
            return map_shard_files(path, [f.stat().st_size for f in files])
        if path.stat().st_size == 0:
            return np.empty(0, dtype=np.uint8)  # mmap cannot map an empty file
        return np.memmap(path, dtype=np.uint8, mode="c")

    def payload_files(self, m: Manifest) -> PayloadFiles:
        """Where version `m`'s payload lies (it must be held): what another process needs to map it."""
        path = self.payload_path(m.run_id, m.version)
        return PayloadFiles(path=path, shard_sizes=[s.raw_size for s in m.shards] if path.is_dir() else None,
                            tensors=[t.model_dump() for t in m.tensors], lock=self.lock(m.run_id, m.version))

    # -- retention -------------------------------------------------------------------------
    def retain(self, run_id: str, keep_last: int) -> list[int]:
        """Apply `shardcast.retention` (the newest `keep_last` versions and the keyframe chain they
        need, payloads of the newest `keep_payloads`, the byte budget). Returns the deleted versions."""
        return retention.retain(self, run_id, keep_last)


def _payload_root(root: Path, asked: Path | None) -> Path | None:
    """The store's payload root: `asked` (recorded on first use), else the recorded one, else None."""
    marker = root / PAYLOAD_ROOT_FILE
    try:
        recorded = Path(marker.read_text().strip())
    except FileNotFoundError:
        recorded = None
    if asked is None:
        return recorded
    asked = asked.resolve()
    if recorded is not None and recorded != asked:
        raise ValueError(f"store {root} keeps its payloads under {recorded}, not {asked}: open it without a "
                         "payload root, or with the same one")
    if recorded is None:
        asked.mkdir(parents=True, exist_ok=True)
        _atomic_write(marker, str(asked).encode())
    return asked


class PartialPayload:
    """The payload of a fetch in flight: decoded, verified shard ranges are written into it, at their
    offset of one file (`pwrite`) or, with `shard_size`, each whole shard as its own file of a directory
    (`shardcast.shard_map`'s layout: decode threads writing one file serialise on its inode lock).

    Written from a buffer the decoder reuses, not through a file-backed mapping: no page fault per
    4 KiB, and a full disk is an `OSError` from the write (a mapping's first write to a page the disk
    cannot hold is a SIGBUS, which kills the process)."""

    def __init__(self, path: Path, total: int, shard_size: int | None = None):
        self.path, self.total, self.shard_size = path, total, shard_size
        self._writers = 0
        self._idle = threading.Condition()
        """close() waits for writes in flight: a decode thread a cancelled fetch left running must not
        write through a descriptor number the process has since reused for another file."""
        if shard_size is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        else:
            path.mkdir()
            fd = os.open(path, os.O_RDONLY)  # the directory: shard files are created relative to it
        self._fd = [fd]  # a box the finalizer can share
        _live_partials.add(str(path))
        self._finalizer = weakref.finalize(self, _close_partial, self._fd, str(path))
        if shard_size is None:
            try:
                os.ftruncate(self._fd[0], total)  # sparse: blocks are allocated by the writes
            except OSError:
                self.discard()
                raise

    def write(self, offset: int, data: np.ndarray | memoryview) -> None:
        """Write `data` at `offset` (thread-safe: pwrite has no shared file position; a shard's own file
        is written by one thread). With `shard_size`, `data` is one whole shard."""
        view = memoryview(data).cast("B")
        if offset < 0 or offset + len(view) > self.total:
            raise ValueError(f"write of {len(view)} bytes at {offset} outside a payload of {self.total}")
        if self.shard_size is not None and (offset % self.shard_size or
                                            len(view) != min(self.shard_size, self.total - offset)):
            raise ValueError(f"write of {len(view)} bytes at {offset}: not one whole shard of {self.shard_size}")
        with self._idle:
            if self._fd[0] < 0:
                raise ValueError(f"{self.path.name} is closed")
            fd = self._fd[0]
            self._writers += 1
        try:
            if self.shard_size is not None:
                out = os.open(shard_file(Path(), offset // self.shard_size), os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                              0o644, dir_fd=fd)
                fd, offset = out, 0
            try:
                while len(view):
                    n = os.pwrite(fd, view, offset)
                    view, offset = view[n:], offset + n
            finally:
                if self.shard_size is not None:
                    os.close(fd)
        finally:
            with self._idle:
                self._writers -= 1
                self._idle.notify_all()

    def close(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._writers == 0)
            self._finalizer()

    def discard(self) -> None:
        """A failed fetch: close and delete (its verified shards stay in the store for a resume)."""
        self.close()
        if self.shard_size is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            self.path.unlink(missing_ok=True)


def _close_partial(fd: list[int], path: str) -> None:
    if fd[0] >= 0:
        os.close(fd[0])
        fd[0] = -1
    _live_partials.discard(path)


_partial_seq = [0]
"""Partial payloads opened by this process: each fetch writes its own file."""
_live_partials: set[str] = set()
"""Partial payloads of this process whose buffer is still referenced (a fetch in flight)."""
_tmp_seq = itertools.count()
"""Temp files written by this process (next() on a count is atomic under the GIL)."""


def _pid_alive(tag: str) -> bool:
    """Whether process `tag` (the pid in a partial's name) is still running."""
    try:
        pid = int(tag)
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
