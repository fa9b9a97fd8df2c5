"""The fetch path's buffers: bodies received into a reused buffer, shards decoded into a reused
scratch and pwritten into the partial payload. What must hold: an oversize body is refused, a
failed fetch leaves verified shards (to resume from) and no partial payload, a resume downloads
only what is missing, and the payload handed to a consumer cannot be changed through its tensors."""

import asyncio
import os
import threading
import time

import numpy as np
import pytest
import torch

from shardcast.errors import FetchFailed
from shardcast.fetch import Fetcher
from shardcast.store import Store


def _fetch(tmp_path, sources_of, trusted, **kw):
    """Start the sources `sources_of()` returns (HostileSource or ShardServer), fetch run v0."""
    async def go():
        started = sources_of()
        urls = []
        for s in started:
            urls.append(await s.start() if hasattr(s, "mode") else f"http://127.0.0.1:{await s.start('127.0.0.1', 0)}")
        try:
            async with Fetcher(Store(tmp_path / "client"), urls, trusted, **kw) as f:
                return await f.fetch("run", 0), started
        finally:
            for s in started:
                await s.stop()

    return asyncio.run(go())


def test_a_body_longer_than_the_manifest_says_is_refused_and_refetched(tmp_path, origin_store, trusted, sc):
    from shardcast.server import ShardServer

    got, (liar, _) = _fetch(tmp_path, lambda: [sc.HostileSource(origin_store, "long"), ShardServer(origin_store)], trusted)
    sc.assert_same(got.tensors(), sc.make_state(0))
    assert liar.shard_requests >= 1


def test_failed_fetch_keeps_verified_shards_drops_the_partial_and_resumes(tmp_path, origin_store, trusted, sc):
    n = len(origin_store.manifest("run", 0).manifest.shards)
    assert n >= 4
    with pytest.raises(FetchFailed):
        _fetch(tmp_path, lambda: [sc.HostileSource(origin_store, "odd")], trusted, max_attempts=2)
    client = Store(tmp_path / "client")
    vdir = client.version_dir("run", 0)
    held = client.held_shards("run", 0)  # what finished before the liar was dropped: even shards only
    assert set(held) <= set(range(0, n, 2))
    assert not client.payload_path("run", 0).exists()
    assert not list(vdir.glob(".payload.*")), "a failed fetch leaves no partial payload behind"
    # Resume from an honest source: only the missing shards are downloaded; the result is exact.
    got, (honest,) = _fetch(tmp_path, lambda: [sc.HostileSource(origin_store, "honest")], trusted)
    assert honest.shard_requests == n - len(held)
    sc.assert_same(got.tensors(), sc.make_state(0))
    assert client.payload_path("run", 0).is_dir()  # a file per shard, each written by its decode thread
    assert np.array_equal(client.payload("run", 0), origin_store.payload("run", 0))


def test_writing_into_the_fetched_tensors_never_changes_the_stored_version(tmp_path, origin_store, trusted, sc):
    from shardcast.server import ShardServer

    got, _ = _fetch(tmp_path, lambda: [ShardServer(origin_store)], trusted)
    tensors = got.tensors()
    tensors["model.embed_tokens.weight"].fill_(7.0)  # a consumer loading in place, say
    assert torch.all(tensors["model.embed_tokens.weight"] == 7.0)
    client = Store(tmp_path / "client")
    assert client.payload_path("run", 0).is_dir()  # a file per shard, each written by its decode thread
    assert np.array_equal(client.payload("run", 0), origin_store.payload("run", 0))
    assert np.array_equal(client.payload("run", 0), origin_store.payload("run", 0))


def test_partial_payload_refuses_writes_outside_it(tmp_path):
    part = Store(tmp_path).open_partial_payload("r", 0, 100)
    try:
        part.write(90, np.zeros(10, np.uint8))
        with pytest.raises(ValueError):
            part.write(95, np.zeros(10, np.uint8))
        with pytest.raises(ValueError):
            part.write(-1, np.zeros(1, np.uint8))
    finally:
        part.discard()
    assert not part.path.exists()


def test_closing_a_partial_payload_waits_for_a_write_in_flight(tmp_path, monkeypatch):
    """A decode thread left running by a cancelled fetch finishes its write before the descriptor
    is closed (a closed, reused descriptor number would put the bytes into another file)."""
    part = Store(tmp_path).open_partial_payload("r", 0, 1 << 20)
    real_pwrite, entered = os.pwrite, threading.Event()

    def slow_pwrite(fd, data, offset):
        entered.set()
        time.sleep(0.3)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", slow_pwrite)
    writer = threading.Thread(target=part.write, args=(0, np.full(1 << 20, 7, np.uint8)))
    writer.start()
    assert entered.wait(5)
    t0 = time.perf_counter()
    part.close()
    assert time.perf_counter() - t0 > 0.1, "close() did not wait for the write in flight"
    writer.join(5)
    monkeypatch.undo()
    assert part.path.read_bytes() == b"\x07" * (1 << 20)
    with pytest.raises(ValueError):
        part.write(0, np.zeros(1, np.uint8))


def test_a_partial_payload_of_shard_files_takes_whole_shards_only_and_commits_to_one_array(tmp_path):
    store = Store(tmp_path)
    part = store.open_partial_payload("r", 0, 10_000, shard_size=4096)
    data = np.arange(10_000, dtype=np.uint32).astype(np.uint8)
    for bad in ((100, data[:4096]), (0, data[:100]), (8192, data[:4096])):  # misaligned, short, past the end
        with pytest.raises(ValueError):
            part.write(*bad)
    for start in (8192, 0, 4096):  # in any order, as decode threads finish
        part.write(start, data[start : start + 4096])
    got = store.commit_partial_payload("r", 0, part)
    assert np.array_equal(got, data) and store.payload_path("r", 0).is_dir()
    assert not list(store.version_dir("r", 0).glob(".payload.*"))
    with pytest.raises(ValueError, match="closed"):
        part.write(0, data[:4096])  # a decode thread left running writes nothing once committed


def test_a_fetched_version_says_where_its_payload_files_are_for_a_process_that_maps_them(tmp_path, origin_store,
                                                                                          trusted, sc):
    # an engine in its own interpreter (vLLM's workers) maps the store's files itself instead of being handed a copy
    from shardcast.shard_map import map_shard_files

    from shardcast.server import ShardServer

    got, _ = _fetch(tmp_path, lambda: [ShardServer(origin_store)], trusted)
    tensors = got.tensors()
    files = tensors.files
    assert files.lock == Store(tmp_path / "client").lock("run", 0) and files.path.exists()
    mapped = (map_shard_files(files.path, files.shard_sizes) if files.shard_sizes is not None
              else np.memmap(files.path, dtype=np.uint8, mode="r"))
    assert [t["name"] for t in files.tensors] == list(tensors)
    for t in files.tensors:
        raw = torch.from_numpy(np.array(mapped[t["offset"]: t["offset"] + t["nbytes"]]))
        assert torch.equal(raw.view(getattr(torch, t["dtype"])).reshape(t["shape"]).view(torch.uint8),
                           tensors[t["name"]].reshape(t["shape"]).view(torch.uint8)), t["name"]
    again = asyncio.run(_held(tmp_path, trusted))  # read back from the store, not fetched: the same files
    assert again.files == files
    sc.assert_same(dict(again.tensors()), got.tensors())


async def _held(tmp_path, trusted):
    async with Fetcher(Store(tmp_path / "client"), [], trusted, offline=True) as f:
        return await f.fetch("run", 0)
