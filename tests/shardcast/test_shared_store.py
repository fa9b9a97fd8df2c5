"""One store per host: processes that share a store directory hold a version once, fetch it once,
and never see a half-written or half-deleted one; retention counts payloads and bytes."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardcast.fetch import Fetcher, read_held
from shardcast.hashing import content_hash
from shardcast.locks import held
from shardcast.publish import PublishOptions, publish
from shardcast.store import Store

WORKER = Path(__file__).with_name("shared_store_worker.py")
WAIT_S = 120.0


def _chain(store, key, sc, n, keyframe_every=8, keep_last=100):
    states, s = [], sc.make_state(0)
    opts = PublishOptions(shard_size=sc.SHARD, keyframe_every=keyframe_every, keep_last=keep_last)
    for v in range(n):
        s = sc.rl_step(s, v) if v else s
        states.append(s)
        publish(store, key, "run", v, s, parent=v - 1 if v else None, options=opts)
    return states


async def _workers(n: int, store: Path, url: str, publisher: str, version: int) -> list[dict]:
    procs = [await asyncio.create_subprocess_exec(sys.executable, str(WORKER), str(store), url, publisher, "run",
                                                  str(version), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(n)]
    try:
        outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), WAIT_S)
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err.decode()[-2000:]
    return [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outs]


def test_processes_sharing_a_store_download_a_version_once_and_hold_it_once(tmp_path, key, sc):
    origin = Store(tmp_path / "origin")
    _chain(origin, key, sc, n=1)
    shared = tmp_path / "host"
    wire = origin.manifest("run", 0).manifest.wire_bytes

    async def go():
        server, url = await sc.serve(origin)
        try:
            got = await _workers(3, shared, url, key.peer_id, 0)
            return got, server.bytes_served
        finally:
            await server.stop()

    got, served = asyncio.run(go())
    want = content_hash(memoryview(np.asarray(origin.payload("run", 0))))
    assert [g["payload"] for g in got] == [want] * 3, "every process reads the exact published version"
    assert sum(g["downloaded"] for g in got) == wire and served == wire, "one download for the host, not one each"
    files = sorted(p.name for p in (shared / "run" / "00000000").iterdir())
    assert files == sorted(["manifest.json", "payload.d", *(p.name for p in origin.version_dir("run", 0).glob("shard_*"))]), \
        "one copy: no second payload, no temp or partial file left behind"


def test_a_process_on_the_host_that_published_fetches_nothing(tmp_path, key, sc):
    shared = Store(tmp_path / "host")
    _chain(shared, key, sc, n=2)

    async def go():
        server, url = await sc.serve(shared)  # the trainer's server over the host's one store
        try:
            return await _workers(2, shared.root, url, key.peer_id, 1), server.bytes_served
        finally:
            await server.stop()

    got, served = asyncio.run(go())
    assert [g["downloaded"] for g in got] == [0, 0] and served == 0
    assert got[0]["payload"] == content_hash(memoryview(np.asarray(shared.payload("run", 1))))


def test_a_dropped_payload_is_rebuilt_from_the_held_wire_shards_without_the_network(tmp_path, key, trusted, sc):
    store = Store(tmp_path / "host", keep_payloads=1)
    states = _chain(store, key, sc, n=4)
    assert [v for v in range(4) if store.payload_path("run", v).exists()] == [3]
    assert store.complete_versions("run") == [0, 1, 2, 3], "wire shards kept: still whole, still served"

    async def go():
        # no server listens there: every byte must come from the store
        async with Fetcher(store, ["http://127.0.0.1:9"], trusted) as f:
            return (await f.fetch("run", 2)).tensors()

    sc.assert_same(asyncio.run(go()), states[2])


def test_retention_keeps_the_run_under_its_byte_budget_and_never_breaks_a_delta_chain(tmp_path, key, sc, caplog):
    probe = Store(tmp_path / "probe")
    _chain(probe, key, sc, n=1)
    one_full = probe.disk_bytes("run")  # one keyframe: wire shards + payload
    store = Store(tmp_path / "host", keep_payloads=4, max_bytes=int(2.2 * one_full))
    _chain(store, key, sc, n=10, keyframe_every=4, keep_last=6)
    held_now = store.versions("run")
    assert store.disk_bytes("run") <= store.max_bytes
    assert held_now[-1] == 9 and store.payload_path("run", 9).exists(), "the newest stays whole"
    for v in held_now:  # every kept delta's parent is held: a late joiner can rebuild each
        m = store.manifest("run", v).manifest
        assert m.encoding == "full" or m.parent in held_now
    assert "over its budget" in caplog.text


def test_retention_leaves_a_version_alone_while_another_process_holds_its_lock(tmp_path, key, sc):
    store = Store(tmp_path / "host")
    _chain(store, key, sc, n=3, keyframe_every=1)
    lock = store.lock("run", 0)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
        "print('held', flush=True); sys.stdin.readline()"), str(lock)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert store.retain("run", keep_last=1) == [1], "v0 is being fetched elsewhere: skipped, not deleted"
        assert store.versions("run") == [0, 2]
    finally:
        holder.stdin.close()
        holder.wait(timeout=WAIT_S)
    assert store.retain("run", keep_last=1) == [0], "a later pass takes it"
    with held(lock):  # the lock file outlives its version (never on a deleted inode)
        assert lock.exists()


def test_a_fetch_goes_on_without_a_lock_a_stopped_process_keeps(tmp_path, key, trusted, sc, monkeypatch, caplog):
    from shardcast import locks

    origin = Store(tmp_path / "origin")
    states = _chain(origin, key, sc, n=1)
    shared = Store(tmp_path / "host")
    lock = shared.lock("run", 0)
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
        "print('held', flush=True); sys.stdin.readline()"), str(lock)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    monkeypatch.setattr(locks, "PATIENCE_S", 0.5)

    async def go():
        server, url = await sc.serve(origin)
        try:
            async with Fetcher(shared, [url], trusted) as f:
                return (await f.fetch("run", 0)).tensors()
        finally:
            await server.stop()

    try:
        assert holder.stdout.readline().strip() == "held"
        sc.assert_same(asyncio.run(go()), states[0])
    finally:
        holder.stdin.close()
        holder.wait(timeout=WAIT_S)
    assert "going on without it" in caplog.text


def test_payloads_kept_elsewhere_are_found_by_every_process_of_the_host_and_go_with_their_versions(
        tmp_path, key, trusted, sc):
    """`Store(payload_root=...)` (`join --store-payloads`, e.g. on tmpfs): the publisher's payloads and a fetch's
    decoded ones lie there, never beside the wire shards; processes that open the store without the flag (the
    host's other roles, subprocesses here) find them from the store's record; retention drops them with their
    versions and counts them in the byte budget; another payload root for the same store is refused."""
    disk, ram = tmp_path / "host", tmp_path / "ram"
    store = Store(disk, keep_payloads=2, payload_root=ram)
    states = _chain(store, key, sc, n=4, keyframe_every=2, keep_last=2)  # v3 a delta on v2
    for v in store.versions("run"):
        assert not any(p.name.startswith(("payload", ".payload")) for p in store.version_dir("run", v).iterdir())
    assert [v for v in range(4) if any((ram / "run" / f"{v:08d}").glob("payload*"))] == [2, 3]
    assert all(store.payload_path("run", v).is_relative_to(ram.resolve()) for v in (2, 3))
    assert store.versions("run") == [2, 3] and not (ram / "run" / "00000000").exists(), "v0 went with its payload"
    assert store.disk_bytes("run") > sum(f.stat().st_size for f in (disk / "run").rglob("shard_*"))

    again = Store(disk)  # no flag: the store's record says where
    assert again.payload_root == ram.resolve()
    sc.assert_same(read_held(again, trusted, "run", 3).tensors(), states[3])
    with pytest.raises(ValueError, match="keeps its payloads under"):
        Store(disk, payload_root=tmp_path / "elsewhere")

    # a process of the host reads the published version from the store and downloads nothing
    async def local():
        server, url = await sc.serve(store)
        try:
            return await _workers(1, disk, url, key.peer_id, 3)
        finally:
            await server.stop()

    got = asyncio.run(local())
    assert got[0]["downloaded"] == 0
    assert got[0]["payload"] == content_hash(memoryview(np.asarray(store.payload("run", 3))))

    # a fetch into another host's store with a payload root decodes there (partial files and all)
    fetched = Store(tmp_path / "host2", payload_root=tmp_path / "ram2")

    async def remote():
        server, url = await sc.serve(store)
        try:
            async with Fetcher(fetched, [url], trusted) as f:
                return (await f.fetch("run", 3)).tensors()
        finally:
            await server.stop()

    sc.assert_same(asyncio.run(remote()), states[3])
    home = tmp_path / "ram2" / "run" / "00000003"
    assert (home / "payload.d").is_dir() or (home / "payload.bin").is_file()
    assert not any(p.name.startswith(".payload") for p in home.iterdir()), "no partial left"
    assert not any(p.name.startswith(("payload", ".payload")) for p in fetched.version_dir("run", 3).iterdir())

