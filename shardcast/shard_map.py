"""A payload kept as one file per shard (`payload.d/raw_00000.bin`, ...), read back as one contiguous
array: each file mapped copy-on-write at its offset inside one reserved range of addresses (mmap with
MAP_FIXED), so tensors that span two shards are still plain views.

Why files per shard: a publisher's threads each write their own shard's raw bytes. Into one file
those writes serialise on the file's inode lock: 3.4-3.6 GB/s at any thread count on the H200 host,
2.8 s of a 10 GB version; a file per thread reached 26 GB/s at 12 threads
(benchmarks/results/publish_scaling-h200.json).

Invariant: every shard but the last is a whole number of pages long (shards are MiB multiples; shards
of a few bytes, in tests, are read into one array instead), so each file starts on a page boundary of
the range; the array's bytes are the files' bytes in order,
and writes into it land in private pages, never in the files.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from pathlib import Path

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT_NONE, _MAP_FIXED, _MAP_NORESERVE = 0, 0x10, 0x4000  # Linux's values (Python's mmap names none of them)


def shard_file(directory: Path, index: int) -> Path:
    return directory / f"raw_{index:05d}.bin"


def map_shard_files(directory: Path, sizes: list[int]) -> np.ndarray:
    """The files `raw_00000.bin`... of `directory` (of `sizes` bytes each) as one read-write, copy-on-write
    uint8 array; unmapped once the array and every view of it are gone. `OSError` if a file is missing
    or of another size."""
    total = sum(sizes)
    if total == 0:
        return np.empty(0, dtype=np.uint8)
    if any(size % mmap.PAGESIZE for size in sizes[:-1]):  # shards of a few bytes (tests): read into one array
        out, offset = np.empty(total, dtype=np.uint8), 0
        for i, size in enumerate(sizes):
            with open(shard_file(directory, i), "rb") as f:
                if f.readinto(memoryview(out[offset:offset + size])) != size or f.read(1):
                    raise OSError(f"{shard_file(directory, i)}: not {size} bytes")
            offset += size
        return out
    base = _libc.mmap(None, total, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if base in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), f"reserving {total} bytes of addresses for {directory}")
    try:
        offset = 0
        for i, size in enumerate(sizes):
            path = shard_file(directory, i)
            fd = os.open(path, os.O_RDONLY)
            try:
                if os.fstat(fd).st_size != size:
                    raise OSError(f"{path}: {os.fstat(fd).st_size} bytes, the manifest says {size}")
                at = _libc.mmap(base + offset, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_FIXED,
                                fd, 0)
                if at != base + offset:
                    raise OSError(ctypes.get_errno(), f"mapping {path} at its offset {offset}")
            finally:
                os.close(fd)  # the mapping keeps the file
            offset += size
    except BaseException:
        _libc.munmap(base, total)
        raise
    owner = (ctypes.c_uint8 * total).from_address(base)
    # not at interpreter exit: a daemon thread may still read the pages then (the process's end unmaps them)
    weakref.finalize(owner, _libc.munmap, base, total).atexit = False
    return np.frombuffer(owner, dtype=np.uint8)
