"""A publisher's payload as one file per shard, read back as one array (shardcast/shard_map.py)."""

import mmap

import numpy as np
import pytest
import torch

from protocol.identity import NodeKey
from shardcast.codec import PayloadView, StateBytes
from shardcast.publish import PublishOptions, publish
from shardcast.shard_map import map_shard_files, shard_file
from shardcast.store import Store


def write_shards(tmp_path, sizes, seed=0):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, sum(sizes), dtype=np.uint8)
    offset = 0
    for i, size in enumerate(sizes):
        shard_file(tmp_path, i).write_bytes(data[offset:offset + size].tobytes())
        offset += size
    return data


@pytest.mark.parametrize("sizes", [[2 * mmap.PAGESIZE, 3 * mmap.PAGESIZE, 1000], [100, 7, 33], [5 * mmap.PAGESIZE]])
def test_shard_files_read_back_as_one_array_and_writes_into_it_never_reach_the_files(tmp_path, sizes):
    data = write_shards(tmp_path, sizes)
    arr = map_shard_files(tmp_path, sizes)
    assert arr.dtype == np.uint8 and np.array_equal(arr, data)
    # a view across the first boundary: one contiguous tensor
    a = min(sizes[0] - 3, len(data) - 8)
    assert arr[a:a + 8].view(np.uint16).tolist() == data[a:a + 8].view(np.uint16).tolist()
    arr[:] = 0  # copy-on-write: private pages
    assert shard_file(tmp_path, 0).read_bytes() == data[:sizes[0]].tobytes()
    assert np.array_equal(map_shard_files(tmp_path, sizes), data)


def test_a_missing_or_resized_shard_file_is_an_os_error_not_a_crash(tmp_path):
    sizes = [mmap.PAGESIZE, mmap.PAGESIZE]
    write_shards(tmp_path, sizes)
    shard_file(tmp_path, 1).write_bytes(b"short")
    with pytest.raises(OSError, match="manifest says"):
        map_shard_files(tmp_path, sizes)
    shard_file(tmp_path, 1).unlink()
    with pytest.raises(OSError):
        map_shard_files(tmp_path, sizes)
    assert map_shard_files(tmp_path, []).size == 0


def test_the_files_stay_mapped_while_a_tensor_views_them_and_are_unmapped_after(tmp_path):
    import gc

    import torch

    sizes = [mmap.PAGESIZE, mmap.PAGESIZE]
    data = write_shards(tmp_path, sizes)

    def mapped() -> int:
        with open("/proc/self/maps") as f:
            return sum(str(tmp_path) in line for line in f)

    view = torch.from_numpy(map_shard_files(tmp_path, sizes))[mmap.PAGESIZE - 2 : mmap.PAGESIZE + 2]
    gc.collect()
    assert mapped() == 2 and view.tolist() == data[mmap.PAGESIZE - 2 : mmap.PAGESIZE + 2].tolist()
    del view
    gc.collect()
    assert mapped() == 0


def test_a_payload_view_over_tensors_reads_the_same_bytes_as_the_stored_payload(tmp_path):
    """`codec.PayloadView`: a delta's parent read from tensors (a member's checkpoint) instead of a payload file,
    byte for byte the payload the publisher laid out, padding and ranges across tensor boundaries included."""
    g = torch.Generator().manual_seed(3)
    state = {"a.weight": torch.randn(300, 257, generator=g).bfloat16(), "b.bias": torch.randn(7, generator=g),
             "c.weight": torch.randn(511, 129, generator=g).half(), "step": torch.tensor([3])}  # unaligned ends: padding
    store = Store(tmp_path / "s")
    m = publish(store, NodeKey.from_seed(b"\x07" * 32), "r", 0, state, options=PublishOptions(shard_size=64 << 10)).manifest
    payload, view = store.payload("r", 0), PayloadView(m.tensors, m.total_bytes, StateBytes(state))
    assert len(view) == len(payload) == m.total_bytes
    rng = np.random.default_rng(0)
    cuts = [(0, m.total_bytes), (0, 1), (m.total_bytes - 5, m.total_bytes)]
    cuts += [tuple(sorted(rng.integers(0, m.total_bytes, 2))) for _ in range(50)]
    cuts += [(s * (64 << 10), min((s + 1) * (64 << 10), m.total_bytes)) for s in range(len(m.shards))]  # the fetcher's reads
    for a, b in cuts:
        assert np.array_equal(view[a:b], payload[a:b]), (a, b)
    with pytest.raises(ValueError, match="contiguous"):
        view[0:10:2]
