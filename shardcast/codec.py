"""Byte layout of a policy version and the shard codec (zstd, XOR deltas).

A state dict becomes one flat payload: each tensor's bytes at a 64-byte-aligned offset, zero
padding between. A shard is a fixed range of that payload. On the wire a full shard is
zstd(raw); a delta shard is zstd(raw XOR parent_raw) over the same range, which is why a delta
needs the parent's layout to be identical (same names, dtypes, shapes, offsets). Consecutive RL
steps change few bits of most bf16 weights (sign and exponent stay), so XOR leaves long zero
runs that zstd squeezes; where few words change at all, a sparse list of them is smaller still
(`shardcast/sparse.py`), chosen per shard by size.
"""

from __future__ import annotations

import bisect
import math
import threading
from typing import TYPE_CHECKING, Protocol

import numpy as np
import zstandard

from shardcast.errors import CorruptShard, TruncatedShard
from shardcast.hashing import content_hash, content_hasher
from shardcast.manifest import ShardEntry, TensorEntry
from shardcast.sparse import decode_sparse, encode_sparse_delta, is_sparse, sparse_count

if TYPE_CHECKING:  # torch is imported where tensors are made: a relay moves bytes and never loads it
    import torch

ALIGN = 64
"""Tensor offsets are multiples of this, so every tensor view over the payload is aligned."""
DEFAULT_SHARD_SIZE = 64 << 20
"""64 MiB: big enough that per-request overhead is <1% on loopback, small enough to spread a
1 GiB version over 16 shards for parallel, multi-source fetch."""
DEFAULT_ZSTD_LEVEL = 1
"""Level 1 compresses bf16 weights to ~0.78 at ~1 GB/s per core here; level 3 gives the same
ratio at ~0.77 GB/s (the entropy is in the mantissa bits, which no level removes)."""
SPARSE_BELOW = 0.5
"""A delta shard with at most this fraction of its words changed is sent sparse without trying
zstd(XOR) too: on bf16 shards (64 MiB, random changes) the sparse form was the smaller at every
fraction measured, 0.02 to 0.77 (1.2 vs 2.0 MiB at 0.02, 20.9 vs 25.3 at 0.48, 30.7 vs 32.4 at 0.77),
and trying both cost 0.41 s a shard against 0.2 for the sparse form alone (cpu-2core)."""


ELEMENT_SIZES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
                 "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
"""Bytes per element of the dtype names manifests carry (others: asked of torch)."""


def dtype_of(name: str) -> torch.dtype:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CorruptShard(f"unknown dtype {name!r}")
    return dt


def element_size(dtype_name: str) -> int:
    """Bytes per element of a manifest dtype name."""
    size = ELEMENT_SIZES.get(dtype_name)
    return size if size is not None else dtype_of(dtype_name).itemsize


def layout(state: dict[str, torch.Tensor]) -> tuple[list[TensorEntry], int]:
    """Tensor index and total payload length for `state` (insertion order kept)."""
    entries, offset = [], 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), offset=offset, nbytes=nbytes))
        offset = -(-(offset + nbytes) // ALIGN) * ALIGN
    total = entries[-1].offset + entries[-1].nbytes if entries else 0
    return entries, total


def flatten(state: dict[str, torch.Tensor]) -> tuple[list[TensorEntry], np.ndarray]:
    """The flat payload of `state` as a uint8 array (one copy of each tensor)."""
    import torch

    entries, total = layout(state)
    buf = np.zeros(total, dtype=np.uint8)
    for e, t in zip(entries, state.values()):
        if e.nbytes:
            src = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            buf[e.offset : e.offset + e.nbytes] = src
    return entries, buf


def unflatten(tensors: list[TensorEntry], payload: np.ndarray) -> dict[str, torch.Tensor]:
    """Tensors viewing `payload` (no copy), ready for `load_weights` / `load_state_dict`."""
    import torch

    base = torch.from_numpy(payload)
    return {e.name: view_of(base, e) for e in tensors}


def view_of(base: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    """Tensor `e` of a payload whose bytes are `base` (uint8), as a view (no copy)."""
    return base[e.offset : e.offset + e.nbytes].view(dtype_of(e.dtype)).reshape(e.shape)


def shard_ranges(total: int, shard_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + shard_size, total)) for s in range(0, total, shard_size)]


def xor_into(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """out = a XOR b, 8 bytes at a time where lengths allow."""
    n8 = len(a) // 8 * 8
    np.bitwise_xor(a[:n8].view(np.uint64), b[:n8].view(np.uint64), out=out[:n8].view(np.uint64))
    np.bitwise_xor(a[n8:], b[n8:], out=out[n8:])
    return out


def encode_shard(index: int, raw: np.ndarray, parent_raw: np.ndarray | None, level: int = DEFAULT_ZSTD_LEVEL,
                 word: int = 2, sparse: bool = True, raw_hash: str | None = None) -> tuple[ShardEntry, bytes]:
    """Wire bytes of one shard (delta against `parent_raw` if given) and its manifest entry.
    A delta is zstd(raw XOR parent) or, when `sparse`, the changed `word`-byte words alone
    (`shardcast.sparse`): those alone where at most SPARSE_BELOW of the words changed, else the smaller
    of the two; both decode to the same raw bytes and carry the same raw hash (`raw_hash`: already
    computed by the caller, from these bytes)."""
    wire = encode_sparse_delta(raw, parent_raw, word, level) if parent_raw is not None and sparse else None
    if wire is None or sparse_count(wire) / max(1, len(raw) // word) > SPARSE_BELOW:
        body = raw if parent_raw is None else xor_into(_scratch(len(raw)), raw, parent_raw)
        dense = zstandard.ZstdCompressor(level=level).compress(memoryview(body))
        wire = dense if wire is None or len(dense) <= len(wire) else wire
    entry = ShardEntry(index=index, raw_size=len(raw), wire_size=len(wire), wire_hash=content_hash(wire),
                       raw_hash=raw_hash or content_hash(memoryview(raw)))
    return entry, wire


_SCRATCH = threading.local()


def _scratch(n: int) -> np.ndarray:
    """This thread's XOR buffer of `n` bytes, kept between shards: a fresh 64 MiB array per shard is
    64 MiB of first-touch page faults each time (0.085 s a shard on cpu-2core, most of a delta shard's
    encoding; worse with a publication's threads faulting at once on the H200 host)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < n:
        buf = _SCRATCH.buf = np.empty(max(n, DEFAULT_SHARD_SIZE), dtype=np.uint8)
    return buf[:n]


def check_wire(entry: ShardEntry, wire: bytes | bytearray | memoryview) -> None:
    """Raise unless `wire` is exactly the shard the manifest promises."""
    if len(wire) < entry.wire_size:
        raise TruncatedShard(f"shard {entry.index}: {len(wire)} of {entry.wire_size} bytes")
    if len(wire) != entry.wire_size or content_hash(wire) != entry.wire_hash:
        raise CorruptShard(f"shard {entry.index}: wire bytes do not match the manifest hash")


def decode_shard(entry: ShardEntry, wire: bytes | bytearray | memoryview, out: np.ndarray, parent_raw: np.ndarray | None) -> None:
    """Decode verified wire bytes into `out` (the shard's payload range) and check the raw hash."""
    if len(out) != entry.raw_size:
        raise CorruptShard(f"shard {entry.index}: output range of {len(out)} bytes, manifest says {entry.raw_size}")
    if is_sparse(wire):
        if parent_raw is None:
            raise CorruptShard(f"shard {entry.index}: a sparse delta in a full version")
        decode_sparse(entry.index, wire, out, parent_raw)
        _check_raw(entry, out)
        return
    try:
        # Straight into the destination: ~1.7x faster than decompress() + copy here.
        with zstandard.ZstdDecompressor().stream_reader(wire) as reader:
            view, n = memoryview(out), 0
            while n < entry.raw_size:
                k = reader.readinto(view[n:])
                if k == 0:
                    break
                n += k
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CorruptShard(f"shard {entry.index}: zstd frame does not decode: {exc}") from exc
    if n != entry.raw_size or extra:
        raise CorruptShard(f"shard {entry.index}: decodes to a size other than the manifest's {entry.raw_size}")
    if parent_raw is not None:
        xor_into(out, out, parent_raw)
    _check_raw(entry, out)


def _check_raw(entry: ShardEntry, out: np.ndarray) -> None:
    if content_hash(memoryview(out)) != entry.raw_hash:
        raise CorruptShard(f"shard {entry.index}: reconstructed bytes do not match the full version's hash")


class TensorBytes(Protocol):
    """A version's tensors as a check reads them: names, each one's dtype and shape, and byte ranges of
    its raw value; a source may read them from disk one range at a time (node/model/streamed_weights.py)."""

    def names(self) -> set[str]: ...
    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype name as a manifest writes it, shape)."""
    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Bytes lo:hi of the tensor (uint8)."""


class StateBytes:
    """`TensorBytes` over tensors in memory (HF names -> tensors)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def names(self) -> set[str]:
        return set(self.state)

    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        t = self.state[name]
        return str(t.dtype).removeprefix("torch."), tuple(t.shape)

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        import torch

        flat = self.state[name].detach().contiguous().reshape(-1).view(torch.uint8)
        return flat[lo:hi].cpu().numpy()


class _Layout:
    """The tensors of a version's payload in offset order: which byte ranges of which tensors a payload range holds."""

    def __init__(self, tensors: list[TensorEntry]):
        self._by_offset = sorted((e for e in tensors if e.nbytes), key=lambda e: e.offset)
        self._starts = [e.offset for e in self._by_offset]

    def spans(self, a: int, b: int):  # noqa: ANN201 (an iterator of (entry, lo, hi))
        """(tensor, lo, hi) for each tensor overlapping payload bytes a..b, in order: its bytes lo..hi of the payload;
        what lies between them is zero padding."""
        for e in self._by_offset[max(bisect.bisect_right(self._starts, a) - 1, 0):]:
            if e.offset >= b:
                break
            lo, hi = max(a, e.offset), min(b, e.offset + e.nbytes)
            if lo < hi:
                yield e, lo, hi


def matches_manifest(tensors: list[TensorEntry], shards: list[ShardEntry], shard_size: int, source: TensorBytes) -> bool:
    """Whether `source` is exactly the version a manifest describes: the same names, dtypes and shapes,
    and every shard's raw bytes hashing to its `raw_hash`. Each shard is hashed as it is read, from the
    byte ranges of the tensors it spans (no shard buffer: memory is the one range `source` reads at a
    time, never the whole version), in payload order (each tensor read once, first byte to last),
    stopping at the first shard that differs."""
    if {e.name for e in tensors} != source.names():
        return False
    for e in tensors:
        if source.header(e.name) != (e.dtype, tuple(e.shape)) or e.nbytes != math.prod(e.shape) * element_size(e.dtype):
            return False
    layout = _Layout(tensors)
    for s in shards:
        a = s.index * shard_size
        b = a + s.raw_size
        h, at = content_hasher(), a
        for e, lo, hi in layout.spans(a, b):
            _zeros_into(h, lo - at)  # alignment padding between tensors is zero
            h.update(source.read(e.name, lo - e.offset, hi - e.offset))
            at = hi
        _zeros_into(h, b - at)
        if h.hexdigest() != s.raw_hash:
            return False
    return True


class PayloadView:
    """A version's flat payload read from its tensors instead of a payload file: `view[a:b]` is bytes a..b
    of the layout `tensors` give (zeros between tensors), read from `source` one tensor range at a time.
    For a delta whose parent a member holds as tensors (its own checkpoint, `source` already checked
    against the parent's manifest) rather than as a payload in the store."""

    def __init__(self, tensors: list[TensorEntry], total_bytes: int, source: TensorBytes):
        self.layout, self.total_bytes, self.source = _Layout(tensors), total_bytes, source

    def __len__(self) -> int:
        return self.total_bytes

    def __getitem__(self, key: slice) -> np.ndarray:
        a, b, step = key.indices(self.total_bytes)
        if step != 1:
            raise ValueError("a payload view is read in contiguous ranges")
        out = np.zeros(max(b - a, 0), dtype=np.uint8)
        for e, lo, hi in self.layout.spans(a, b):
            out[lo - a : hi - a] = self.source.read(e.name, lo - e.offset, hi - e.offset)
        return out


_ZEROS = bytes(1 << 16)


def _zeros_into(h, n: int) -> None:  # noqa: ANN001 (a content_hasher)
    while n > 0:
        h.update(_ZEROS[: min(n, len(_ZEROS))])
        n -= len(_ZEROS)
