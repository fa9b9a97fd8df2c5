"""Sparse delta shards: the positions and XOR of the words that changed, nothing else.

A real RL step at an LLM learning rate changes few bf16 values (AdamW moves a weight by ~lr, below
half a bf16 ulp for most weights), so most of an XOR delta is zeros. This format lists only the
changed words: delta-coded indices (each the gap to the previous, >= 1) and the XOR of old and new
word at each, both byte-plane shuffled (all first bytes, then all second bytes, ...) and zstd'd.
The publisher uses it for a shard whose words changed at most `codec.SPARSE_BELOW` of the time (where it
was smaller than zstd(XOR) at every fraction measured) and above that only when it is smaller
(`codec.encode_shard`).

Wire layout (little-endian), self-describing so a manifest needs no new field:
    magic b"SCS1" | word u8 (1, 2, 4, 8) | index_bytes u8 (4, 8) | pad u16 | count u64
    | idx_len u64 | val_len u64 | zstd(gaps, byte planes)[idx_len] | zstd(xor words, planes)[val_len]

Invariant: a sparse shard is applied only if every index is strictly increasing and inside the
shard, and every section decodes to exactly the size its header claims; otherwise
`InvalidSparseDelta` (a `CorruptShard`) before a byte of the output is trusted. The caller's raw
hash check (the full version's bytes) then proves the result, as for XOR deltas.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import zstandard

from shardcast.errors import InvalidSparseDelta

MAGIC = b"SCS1"
_HEADER = struct.Struct("<4sBBHQQQ")
HEADER_SIZE = _HEADER.size
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {4: np.int32, 8: np.int64}


def is_sparse(wire: bytes | bytearray | memoryview) -> bool:
    return bytes(wire[:4]) == MAGIC


def _planes(a: np.ndarray) -> np.ndarray:
    """Byte planes of a 1-D array of fixed-width words: all byte 0s, then all byte 1s, ..."""
    return np.ascontiguousarray(a.view(np.uint8).reshape(len(a), a.itemsize).T)


def _unplanes(flat: np.ndarray, n: int, dtype) -> np.ndarray:
    width = np.dtype(dtype).itemsize
    return np.ascontiguousarray(flat.reshape(width, n).T).view(dtype).reshape(n)


def encode_sparse_delta(raw: np.ndarray, parent: np.ndarray, word: int, level: int) -> bytes | None:
    """Sparse wire bytes for a shard whose raw bytes are `raw` and its parent's `parent` (uint8), or None where the
    shard length is not a whole number of `word`-byte words. The changed words are found by comparing the two
    (through a mask: 2.7x faster than on the words themselves) and their XOR taken there alone: the XOR of a whole
    shard was a 64 MiB write and a read of it again, on publication threads that share the host's memory bandwidth
    with every role beside them."""
    if word not in _UINT or len(raw) % word or len(parent) != len(raw):
        return None
    new, old = raw.view(_UINT[word]), parent.view(_UINT[word])
    mask = mask_scratch(len(new))
    np.not_equal(new, old, out=mask)
    idx = np.flatnonzero(mask)
    index_bytes = 4 if len(new) < 2**31 else 8
    gaps = np.empty(len(idx), dtype=_INT[index_bytes])
    if len(idx):
        gaps[0] = idx[0] + 1
        np.subtract(idx[1:], idx[:-1], out=gaps[1:], casting="unsafe")
    cctx = zstandard.ZstdCompressor(level=level)
    idx_z = cctx.compress(_planes(gaps).data) if len(idx) else b""
    val_z = cctx.compress(_planes(new[idx] ^ old[idx]).data) if len(idx) else b""
    return _HEADER.pack(MAGIC, word, index_bytes, 0, len(idx), len(idx_z), len(val_z)) + idx_z + val_z


_SCRATCH = threading.local()


def mask_scratch(n: int) -> np.ndarray:
    """This thread's changed-word mask of `n` entries, kept between shards: a fresh 32 MiB mask per
    64 MiB shard is allocated by mmap (glibc's ceiling for heap allocations is 32 MiB) and page-faulted
    in every time; with a publication's threads faulting and unmapping at once, two threads took 52 ms
    for the pair of masks one thread makes in 6.6 (cpu-2core)."""
    buf = getattr(_SCRATCH, "mask", None)
    if buf is None or len(buf) < n:
        buf = _SCRATCH.mask = np.empty(n, dtype=bool)
    return buf[:n]


def sparse_count(wire: bytes) -> int:
    """Changed words a sparse shard `encode_sparse_delta` just made lists (its header's count)."""
    return _HEADER.unpack_from(wire)[4]


def _zstd_exact(data: memoryview, nbytes: int, what: str, index: int) -> np.ndarray:
    """Decompress `data` into a new array of exactly `nbytes` (the header's claim), or raise."""
    out = np.empty(nbytes, dtype=np.uint8)
    if nbytes == 0:
        if len(data):
            raise InvalidSparseDelta(f"shard {index}: {what} section has bytes but no entries")
        return out
    try:
        with zstandard.ZstdDecompressor().stream_reader(data) as reader:
            view, n = memoryview(out), 0
            while n < nbytes:
                k = reader.readinto(view[n:])
                if k == 0:
                    break
                n += k
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise InvalidSparseDelta(f"shard {index}: {what} section does not decode: {exc}") from exc
    if n != nbytes or extra:
        raise InvalidSparseDelta(f"shard {index}: {what} section is not the {nbytes} bytes its header claims")
    return out


def decode_sparse(index: int, wire: bytes | bytearray | memoryview, out: np.ndarray, parent_raw: np.ndarray) -> None:
    """out = parent_raw with the listed words XORed; typed error on any malformed input."""
    view = memoryview(wire)
    if len(view) < HEADER_SIZE:
        raise InvalidSparseDelta(f"shard {index}: sparse header truncated")
    magic, word, index_bytes, _, count, idx_len, val_len = _HEADER.unpack_from(view)
    if magic != MAGIC or word not in _UINT or index_bytes not in _INT:
        raise InvalidSparseDelta(f"shard {index}: bad sparse header (word {word}, index bytes {index_bytes})")
    if len(out) % word or len(parent_raw) != len(out):
        raise InvalidSparseDelta(f"shard {index}: {len(out)} bytes is not a whole number of {word}-byte words")
    nwords = len(out) // word
    if count > nwords:
        raise InvalidSparseDelta(f"shard {index}: {count} changed words in a shard of {nwords}")
    if HEADER_SIZE + idx_len + val_len != len(view):
        raise InvalidSparseDelta(f"shard {index}: section lengths do not add up to the wire size")
    gaps = _unplanes(_zstd_exact(view[HEADER_SIZE:HEADER_SIZE + idx_len], count * index_bytes, "index", index), count, _INT[index_bytes])
    vals = _unplanes(_zstd_exact(view[HEADER_SIZE + idx_len:], count * word, "value", index), count, _UINT[word])
    if count:
        if gaps.min() <= 0:
            kind = "repeats (overlapping)" if (gaps == 0).any() else "goes backwards (unsorted)"
            raise InvalidSparseDelta(f"shard {index}: an index {kind}")
        if int(gaps.max()) > nwords:
            raise InvalidSparseDelta(f"shard {index}: an index lies outside the shard's {nwords} words")
        idx = np.cumsum(gaps, dtype=np.int64) - 1
        if idx[-1] >= nwords:
            raise InvalidSparseDelta(f"shard {index}: index {int(idx[-1])} lies outside the shard's {nwords} words")
    np.copyto(out, parent_raw)
    if count:
        words = out.view(_UINT[word])
        words[idx] ^= vals


__all__ = ["MAGIC", "InvalidSparseDelta", "decode_sparse", "encode_sparse_delta", "is_sparse", "mask_scratch",
           "sparse_count"]
