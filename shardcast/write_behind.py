"""Big files written without a backlog of dirty pages: each piece's writeback is started as soon as it is
written (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`: the kernel begins writing those pages and returns,
blocking only while the disk's queue is full, so a writer faster than its disk goes at the disk's pace; the
pages stay in the page cache for readers).

Why: on one host the trainer writes a policy version's files (a 10 GB bf16 payload, then its wire shards)
to the disk the coordinator's store fsyncs on. Left to the kernel's background writeback, GBs of dirty pages
pile up, and an fsync of a few KB waits behind them (ext4's ordered journal flushes the data its commit
covers): the coordinator's commits took up to 7.9 s and the trainer's announce went 10 s without a reply
(session 22, one H200). Started piece by piece, the backlog stays a few pieces deep (`python -m
benchmarks.commit_stalls --writers write-behind,end`). The approach databases take (RocksDB's
bytes_per_sync, PostgreSQL's backend_flush_after). Used for what nobody on the host waits for: a publisher's
wire shards once the version is announced (`Store.put_shard(behind=True)`). Elsewhere than Linux, or where
the file system refuses (tmpfs, a pipe), it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

PIECE_BYTES = 16 << 20
"""Bytes written between two starts of writeback."""

_SYNC_FILE_RANGE_WRITE = 2
"""<fcntl.h>: start writeback of the range's dirty pages not yet under writeback; do not wait for it."""


def _libc_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Begin writing `nbytes` at `offset` of `fd` to its disk, without waiting for it (only, when the disk's
    queue is full, for room in it); a no-op where unsupported."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # an error (tmpfs, a pipe) changes nothing


def write_behind(f, data: bytes | bytearray | memoryview) -> None:
    """`f.write(data)` (a file opened "wb", at its start or anywhere), starting each piece's writeback as it goes."""
    view = memoryview(data).cast("B")
    fd, at = f.fileno(), f.tell()
    for a in range(0, len(view), PIECE_BYTES):
        piece = view[a : a + PIECE_BYTES]
        f.write(piece)
        f.flush()
        start_writeback(fd, at + a, len(piece))
