"""Append-only segment files holding accepted rollouts' signed envelopes (`u32 length | envelope`).

Invariant: bytes are fsynced before a reply acknowledges the index rows that point at them: at once
by `append` (`fsync_each`), or by `sync` from another thread before the caller's reply goes out
(the coordinator's deferred mode, `protocol.store`). Bytes past the last indexed record of a segment
(a crash between the two steps) were never acknowledged and are cut off on open; a segment no index
row points at any more (pruned) is deleted, never the one being appended to. A record is the submitter's signed envelope as it arrived, so a segment can
be read and re-verified without the index.
"""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

SEGMENT_BYTES = 256 << 20
"""A new segment file starts once the current one passes this size."""
_REC = struct.Struct(">I")


class Segments:
    def __init__(self, directory: Path, fsync_each: bool = True):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync_each = fsync_each
        self._fd: int | None = None  # each process appends to a fresh segment
        self._fd_lock = threading.Lock()  # `sync` (another thread) against `_open_new` closing the fd
        self.current = ""
        self._size = 0

    def append(self, envelopes: list[bytes]) -> list[tuple[str, int, int]]:
        """Append (and fsync, with `fsync_each`); (segment, offset, length) per envelope, for index rows
        committed next."""
        if not envelopes:
            return []
        if self._fd is None or self._size > SEGMENT_BYTES:
            self._open_new()
        out, chunks, pos = [], [], self._size
        for env in envelopes:
            chunks.append(_REC.pack(len(env)) + env)
            out.append((self.current, pos + _REC.size, len(env)))
            pos += _REC.size + len(env)
        os.write(self._fd, b"".join(chunks))
        if self.fsync_each:
            os.fsync(self._fd)
        self._size = pos
        return out

    def sync(self) -> None:
        """fsync what `append` wrote (safe from another thread: it syncs a duplicate of the descriptor)."""
        with self._fd_lock:
            fd = None if self._fd is None else os.dup(self._fd)
        if fd is not None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def sizes(self) -> dict[str, int]:
        return {seg.name: seg.stat().st_size for seg in self.dir.glob("seg-*.log")}

    def read(self, segment: str, offset: int, length: int) -> bytes:
        with open(self.dir / segment, "rb") as f:
            f.seek(offset)
            return f.read(length)

    def cut_unacknowledged_tails(self, ends: dict[str, int]) -> None:
        """`ends`: segment -> end of its last indexed record. Cut what lies past it; delete unindexed segments."""
        for seg in self.dir.glob("seg-*.log"):
            end = ends.get(seg.name, 0)
            if seg.stat().st_size > end:
                os.truncate(seg, end)
            if end == 0:
                seg.unlink()

    def delete_unreferenced(self, referenced: set[str]) -> list[str]:
        """Delete every segment no index row points at (except the one being appended to)."""
        gone = []
        for seg in sorted(self.dir.glob("seg-*.log")):
            if seg.name not in referenced and seg.name != self.current:
                seg.unlink()
                gone.append(seg.name)
        return gone

    def _open_new(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)  # a segment is left only once its bytes are on disk (every 256 MB: inline)
        existing = sorted(self.dir.glob("seg-*.log"))
        n = int(existing[-1].stem[4:]) + 1 if existing else 0
        name = f"seg-{n:06d}.log"
        fd = os.open(self.dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with self._fd_lock:
            if self._fd is not None:
                os.close(self._fd)
            self._fd, self.current, self._size = fd, name, 0
        dfd = os.open(self.dir, os.O_RDONLY)  # the new name itself must survive a crash
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def close(self) -> None:
        if self._fd is not None:
            with self._fd_lock:
                os.close(self._fd)
                self._fd = None
