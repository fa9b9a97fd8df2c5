"""A publisher's payload as one file per shard, read back as one array (shardcast/shard_map.py)."""

import mmap

import numpy as np
import pytest

from shardcast.shard_map import map_shard_files, shard_file


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
