"""Files written behind (`shardcast.write_behind`): the same bytes as a plain write, each piece's writeback
started as it is written, and nothing raised where the kernel refuses (tmpfs, a pipe)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import shardcast.write_behind as wb
from shardcast.codec import flatten
from shardcast.publish import PublishOptions, publish, publish_stream
from shardcast.store import Store


def test_a_file_written_behind_holds_the_same_bytes_and_each_piece_was_started(tmp_path, monkeypatch):
    started: list[tuple[int, int]] = []
    real = wb._sync_file_range

    def recording(fd, offset, nbytes, flags):
        started.append((offset, nbytes))
        return real(fd, offset, nbytes, flags) if real is not None else 0

    monkeypatch.setattr(wb, "PIECE_BYTES", 1000)
    monkeypatch.setattr(wb, "_sync_file_range", recording)
    data = np.random.default_rng(0).standard_normal(1111).astype(np.float32)  # 4,444 bytes, not uint8
    path = tmp_path / "f.bin"
    with open(path, "wb") as f:
        f.write(b"head")  # written behind from where the file is, not from its start
        wb.write_behind(f, memoryview(data))
    assert path.read_bytes() == b"head" + data.tobytes()
    assert started == [(4, 1000), (1004, 1000), (2004, 1000), (3004, 1000), (4004, 444)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_on_linux_the_kernel_call_is_there_and_refusals_change_nothing(tmp_path):
    assert wb._sync_file_range is not None  # the path every store on Linux takes
    r, w = os.pipe()  # sync_file_range refuses a pipe (ESPIPE): the write still stands
    try:
        wb.start_writeback(w, 0, 10)
    finally:
        os.close(r), os.close(w)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(shm, f"write-behind-{os.getpid()}.bin")
    try:
        with open(path, "wb") as f:
            wb.write_behind(f, b"x" * (3 * wb.PIECE_BYTES // 2))
        assert os.path.getsize(path) == 3 * wb.PIECE_BYTES // 2
    finally:
        os.remove(path)


def test_a_streamed_versions_wire_shards_are_written_behind_and_nothing_members_wait_for_is(tmp_path, monkeypatch,
                                                                                             key, sc):
    started: list[int] = []
    monkeypatch.setattr(wb, "_sync_file_range", lambda fd, offset, nbytes, flags: started.append(nbytes) or 0)
    opts = PublishOptions(shard_size=sc.SHARD, threads=2)
    streamed = Store(tmp_path / "streamed")
    tensors, payload = flatten(sc.make_state(0))
    signed = publish_stream(streamed, key, "run", 0, tensors, payload, iter([len(payload)]), None, opts)
    wire = sorted(streamed.shard_path("run", 0, s.index).stat().st_size for s in signed.manifest.shards)
    assert len(wire) > 1 and sorted(started) == wire  # the wire shards (after the announce), and only they
    started.clear()
    one_step = Store(tmp_path / "one-step")  # `publish` lists the version only once its wire shards are written
    publish(one_step, key, "run", 0, sc.make_state(0), options=opts)
    assert started == []
    one_step.put_shard("run", 9, 0, b"x" * 1000)  # a fetch's: left to the page cache
    assert started == []
