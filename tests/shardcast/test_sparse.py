"""Sparse delta shards: honest round trips are bit-exact and never larger than XOR; malformed
ones (indices outside the shard, repeated, unsorted, lying sizes, wrong values) are refused as
corrupt before anything is stored or served."""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest
import torch
import zstandard

from shardcast.codec import check_wire, decode_shard, encode_shard, flatten
from shardcast.errors import CorruptShard, FetchFailed, InvalidSparseDelta
from shardcast.fetch import fetch_version
from shardcast.manifest import Manifest, SignedManifest
from shardcast.publish import PublishOptions, publish
from shardcast.sparse import is_sparse
from shardcast.store import Store


def _few_changed(state: dict[str, torch.Tensor], share: float, seed: int = 5) -> dict[str, torch.Tensor]:
    """Nudge about `share` of every float tensor's elements by one ulp-ish step."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        if v.is_floating_point():
            mask = torch.rand(v.shape, generator=g) < share
            out[k] = torch.where(mask, (v.float() * 1.02 + 1e-3).to(v.dtype), v)
        else:
            out[k] = v
    return out


def _pair(word: int, n: int = 65536, changed: int = 500, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    parent = rng.integers(0, 256, n * word, dtype=np.uint8)
    raw = parent.copy()
    idx = rng.choice(n, changed, replace=False)
    raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[word])[idx] ^= 1
    return raw, parent


@pytest.mark.parametrize("word", [1, 2, 4])
def test_sparse_shard_round_trips_bit_exact_for_fp8_bf16_fp32_words(word):
    raw, parent = _pair(word)
    entry, wire = encode_shard(0, raw, parent, word=word)
    assert is_sparse(wire)
    _, xor_wire = encode_shard(0, raw, parent, word=word, sparse=False)
    assert len(wire) < len(xor_wire) and not is_sparse(xor_wire)
    out = np.empty_like(raw)
    check_wire(entry, wire)
    decode_shard(entry, wire, out, parent)
    assert np.array_equal(out, raw)
    same_entry, same = encode_shard(0, parent.copy(), parent, word=word)  # nothing changed: empty list
    decode_shard(same_entry, same, out, parent)
    assert np.array_equal(out, parent)


@pytest.mark.parametrize("share", [0.0001, 0.01, 0.3, 1.0])
def test_each_delta_shard_is_sparse_below_half_changed_else_the_smaller_form_and_round_trips(sc, share):
    from shardcast.codec import SPARSE_BELOW
    from shardcast.sparse import encode_sparse_delta

    state = sc.make_state(0)
    moved = _few_changed(state, share)
    _, p = flatten(state)
    _, c = flatten(moved)
    entry, wire = encode_shard(0, c, p)
    _, xor_wire = encode_shard(0, c, p, sparse=False)
    sparse_wire = encode_sparse_delta(c, p, 2, 1)
    changed = np.count_nonzero((c ^ p).view(np.uint16)) / (len(c) // 2)
    if changed <= SPARSE_BELOW:  # sent sparse without trying zstd(XOR): and it is the smaller form here
        assert is_sparse(wire) and wire == sparse_wire and len(sparse_wire) < len(xor_wire)
    else:
        assert len(wire) == min(len(xor_wire), len(sparse_wire))
        assert is_sparse(wire) == (len(sparse_wire) < len(xor_wire))
    out = np.empty_like(c)
    decode_shard(entry, wire, out, p)
    assert np.array_equal(out, c)


def test_sparse_delta_version_fetched_bit_exact_and_smaller_than_xor(tmp_path, key, trusted, sc):
    v0 = sc.make_state(0)
    v1 = _few_changed(v0, 0.01)
    opts = PublishOptions(shard_size=sc.SHARD)
    origin, xor_origin = Store(tmp_path / "origin"), Store(tmp_path / "xor")
    publish(origin, key, "run", 0, v0, options=opts)
    publish(xor_origin, key, "run", 0, v0, options=opts)
    m = publish(origin, key, "run", 1, v1, parent=0, options=opts).manifest
    mx = publish(xor_origin, key, "run", 1, v1, parent=0, options=PublishOptions(shard_size=sc.SHARD, sparse=False)).manifest
    assert m.encoding == "delta"
    kinds = [is_sparse(origin.read_shard("run", 1, i)) for i in range(len(m.shards))]
    assert sum(kinds) >= len(kinds) // 2, kinds
    assert all(a.wire_size <= b.wire_size for a, b in zip(m.shards, mx.shards))
    assert m.wire_bytes * 1.1 < mx.wire_bytes, (m.wire_bytes, mx.wire_bytes)

    async def go():
        server, url = await sc.serve(origin)
        try:
            client = Store(tmp_path / "client")
            await fetch_version(client, [url], trusted, "run", 0)
            got = await fetch_version(client, [url], trusted, "run", 1)
            sc.assert_same(got.tensors(), v1)
            assert got.wire_bytes_downloaded == m.wire_bytes
        finally:
            await server.stop()

    asyncio.run(go())


def _wire(word: int, gaps: list[int], vals: list[int], index_bytes: int = 4, count: int | None = None) -> bytes:
    """Hand-built sparse wire bytes (the layout documented in shardcast/sparse.py)."""
    it = {4: np.int32, 8: np.int64}[index_bytes]
    ut = {1: np.uint8, 2: np.uint16, 4: np.uint32}[word]
    g = np.array(gaps, dtype=it).view(np.uint8).reshape(len(gaps), index_bytes).T.tobytes()
    v = np.array(vals, dtype=ut).view(np.uint8).reshape(len(vals), word).T.tobytes()
    c = zstandard.ZstdCompressor()
    gz, vz = c.compress(g), c.compress(v)
    n = len(gaps) if count is None else count
    return struct.pack("<4sBBHQQQ", b"SCS1", word, index_bytes, 0, n, len(gz), len(vz)) + gz + vz


@pytest.mark.parametrize("gaps,what", [
    ([1, 5, 65531], "outside"),         # indices 0, 5, 65536 in a 65536-word shard
    ([1, 3, 2**20], "outside"),          # a gap larger than the shard
    ([3, 0, 2], "overlapping"),          # index 2 twice
    ([10, -4, 2], "unsorted"),           # 9 then 5
])
def test_sparse_indices_outside_overlapping_or_unsorted_are_corrupt(gaps, what):
    raw, parent = _pair(2)
    out = np.zeros_like(raw)
    wire = _wire(2, gaps, [1] * len(gaps))
    with pytest.raises(InvalidSparseDelta, match=what):
        from shardcast.sparse import decode_sparse
        decode_sparse(0, wire, out, parent)
    assert not out.any()  # nothing was written before the indices were checked


def test_sparse_sections_that_lie_about_their_size_are_corrupt():
    raw, parent = _pair(2)
    out = np.empty_like(raw)
    from shardcast.sparse import decode_sparse
    for wire in (_wire(2, [1, 2], [1, 1], count=3),          # header claims 3 entries, sections hold 2
                 _wire(2, [1, 2], [1, 1])[:-3],               # value section cut short
                 _wire(2, [1, 2], [1, 1], count=10**9),       # more entries than the shard has words
                 b"SCS1" + b"\x00" * 5):                      # header truncated
        with pytest.raises(InvalidSparseDelta):
            decode_sparse(0, wire, out, parent)


def test_sparse_decode_to_the_wrong_values_fails_the_full_version_hash():
    raw, parent = _pair(2, changed=3)
    entry, _ = encode_shard(0, raw, parent)
    changed = np.flatnonzero(raw.view(np.uint16) != parent.view(np.uint16))
    gaps = np.diff(changed, prepend=-1).tolist()
    forged = _wire(2, gaps, [2, 2, 2])  # right positions, wrong new values
    forged_entry = entry.model_copy(update={"wire_size": len(forged)})
    with pytest.raises(CorruptShard, match="full version's hash"):
        decode_shard(forged_entry, forged, np.empty_like(raw), parent)


def test_publisher_signed_bad_sparse_shard_is_never_stored_or_served(tmp_path, key, trusted, sc):
    """Even a manifest the trusted key signed cannot get a malformed sparse shard stored: the
    wire hash passes, the index check refuses it, and the fetch fails without keeping it."""
    v0 = sc.make_state(0)
    v1 = _few_changed(v0, 0.001)
    opts = PublishOptions(shard_size=sc.SHARD)
    origin = Store(tmp_path / "origin")
    publish(origin, key, "run", 0, v0, options=opts)
    m = publish(origin, key, "run", 1, v1, parent=0, options=opts).manifest
    bad = _wire(2, [3, 0, 2], [1, 1, 1])  # overlapping indices
    from shardcast.hashing import content_hash
    shards = list(m.shards)
    shards[0] = shards[0].model_copy(update={"wire_size": len(bad), "wire_hash": content_hash(bad)})
    forged = Manifest.model_validate({**m.model_dump(), "shards": [s.model_dump() for s in shards]})
    origin.put_manifest(SignedManifest.sign(forged, key))
    origin.put_shard("run", 1, 0, bad)

    async def go():
        server, url = await sc.serve(origin)
        try:
            client = Store(tmp_path / "client")
            await fetch_version(client, [url], trusted, "run", 0)
            with pytest.raises(FetchFailed):
                await fetch_version(client, [url], trusted, "run", 1, max_attempts=2)
            assert 0 not in client.held_shards("run", 1)
            assert not client.payload_path("run", 1).exists()
        finally:
            await server.stop()

    asyncio.run(go())


def test_source_sending_bad_sparse_bytes_is_dropped_and_the_shard_refetched(tmp_path, key, trusted, sc):
    v0 = sc.make_state(0)
    v1 = _few_changed(v0, 0.001)
    opts = PublishOptions(shard_size=sc.SHARD)
    origin = Store(tmp_path / "origin")
    publish(origin, key, "run", 0, v0, options=opts)
    publish(origin, key, "run", 1, v1, parent=0, options=opts)

    async def go():
        liar = sc.HostileSource(origin, "corrupt")
        liar_url = await liar.start()
        server, url = await sc.serve(origin)
        try:
            client = Store(tmp_path / "client")
            await fetch_version(client, [url], trusted, "run", 0)
            got = await fetch_version(client, [liar_url, url], trusted, "run", 1)
            sc.assert_same(got.tensors(), v1)
            assert liar.shard_requests >= 1
        finally:
            await server.stop()
            await liar.stop()

    asyncio.run(go())
