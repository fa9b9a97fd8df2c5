"""Real processes die and come back: fetches finish from the others and resume where they stopped;
peers and relays serve what they verified."""

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from shardcast.fetch import Fetcher
from shardcast.publish import PublishOptions, publish
from shardcast.relay import mirror
from shardcast.server import ShardServer
from shardcast.store import Store

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "node.cli"]


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return await asyncio.create_subprocess_exec(*CLI, *args, cwd=REPO, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def _serve_process(store: Store, mibps: float) -> tuple[asyncio.subprocess.Process, str]:
    proc = await _spawn("shardcast", "serve", "--store", str(store.root), "--port", "0", "--uplink-mibps", str(mibps))
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()  # type: ignore[union-attr]
    port = re.search(r":(\d+)\s*$", line)
    assert port, f"server did not start: {line!r}"
    return proc, f"http://127.0.0.1:{port.group(1)}"


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGKILL)


@pytest.mark.slow
def test_source_dies_mid_transfer_and_fetch_completes_from_the_others(tmp_path, origin_store, trusted, sc):
    async def go():
        doomed, doomed_url = await _serve_process(origin_store, mibps=0.5)
        server, good_url = await sc.serve(origin_store, uplink_bytes_per_s=1 << 20)
        try:
            async with Fetcher(Store(tmp_path / "client"), [doomed_url, good_url], trusted, stall_timeout=2.0) as f:
                task = asyncio.create_task(f.fetch("run", 0))
                while f.pool.sources[0].bytes_received == 0:  # the doomed source is mid-transfer
                    await asyncio.sleep(0.02)
                _kill(doomed)
                got = await asyncio.wait_for(task, 60)
                return got, f.pool.sources
        finally:
            _kill(doomed)
            await doomed.wait()
            await server.stop()

    got, (dead, alive) = asyncio.run(go())
    sc.assert_same(got.tensors(), sc.make_state(0))
    assert dead.bytes_received > 0 and (dead.dropped or dead.failures), "the dead source was used, then given up"
    assert alive.bytes_received > dead.bytes_received


@pytest.mark.slow
def test_fetch_resumes_after_the_client_is_killed(tmp_path, origin_store, trusted, key, sc):
    client = Store(tmp_path / "client")
    total_wire = origin_store.manifest("run", 0).manifest.wire_bytes

    async def go():
        server, url = await sc.serve(origin_store, uplink_bytes_per_s=512 << 10)
        try:
            proc = await _spawn("shardcast", "fetch", "--store", str(client.root), "--source", url, "--run", "run",
                                "--version", "0", "--trust", key.peer_id, "--no-progress")
            try:
                for _ in range(3000):
                    if len(client.held_shards("run", 0)) >= 4:
                        break
                    await asyncio.sleep(0.01)
            finally:
                _kill(proc)
                await proc.wait()
            held_at_kill = len(client.held_shards("run", 0))
            async with Fetcher(client, [url], trusted) as f:
                got = await f.fetch("run", 0)
            return held_at_kill, got
        finally:
            await server.stop()

    held_at_kill, got = asyncio.run(go())
    assert 4 <= held_at_kill < len(got.manifest.shards)
    assert 0 < got.wire_bytes_downloaded < total_wire, "the second run reused the first run's shards"
    sc.assert_same(got.tensors(), sc.make_state(0))
    assert not [p for p in (client.root / "run" / "00000000").iterdir() if p.name.endswith(".tmp")]


def test_peers_serve_each_other_verified_shards(tmp_path, origin_store, trusted, sc):
    async def go():
        origin, origin_url = await sc.serve(origin_store, uplink_bytes_per_s=4 << 20)
        a_store, b_store = Store(tmp_path / "a"), Store(tmp_path / "b")
        a_server, a_url = await sc.serve(a_store)
        try:
            async with Fetcher(a_store, [origin_url], trusted) as fa, Fetcher(b_store, [origin_url, a_url], trusted) as fb:
                first = await fa.fetch("run", 0)
                second = await fb.fetch("run", 0)
            return first, second, a_server.bytes_served
        finally:
            await a_server.stop()
            await origin.stop()

    first, second, served_by_peer = asyncio.run(go())
    sc.assert_same(first.tensors(), sc.make_state(0))
    sc.assert_same(second.tensors(), sc.make_state(0))
    assert served_by_peer > 0, "the peer, being the faster source, served shards onward"


def test_relay_mirrors_new_versions_as_they_appear(tmp_path, origin_store, key, trusted, sc):
    async def go():
        origin, origin_url = await sc.serve(origin_store)
        relay_store = Store(tmp_path / "relay")
        relay_server, relay_url = await sc.serve(relay_store)
        stop, wake = asyncio.Event(), asyncio.Event()
        try:
            async with Fetcher(relay_store, [origin_url], trusted) as upstream:
                task = asyncio.create_task(mirror(upstream, "run", keep_last=3, poll_s=5.0, stop=stop, wake=wake))
                for v in (1, 2):
                    await asyncio.sleep(0.1)
                    publish(origin_store, key, "run", v, sc.rl_step(sc.make_state(0), v), parent=v - 1,
                            options=PublishOptions(shard_size=sc.SHARD))
                    wake.set()  # what a PolicyAnnounce on gossip does
                for _ in range(500):
                    if relay_store.complete_versions("run") == [0, 1, 2]:
                        break
                    await asyncio.sleep(0.01)
                stop.set()
                await asyncio.wait_for(task, 10)
            async with Fetcher(Store(tmp_path / "downstream"), [relay_url], trusted) as f:
                got = await f.fetch("run", 2)
            return relay_store.complete_versions("run"), got
        finally:
            await relay_server.stop()
            await origin.stop()

    held, got = asyncio.run(go())
    assert held == [0, 1, 2]
    assert got.manifest.encoding == "delta"
    sc.assert_same(got.tensors(), sc.rl_step(sc.make_state(0), 2))


def test_a_relay_woken_before_the_wire_shards_mirrors_the_version_once_they_are_listed(tmp_path, origin_store, key,
                                                                                        trusted, sc):
    """An announcement comes once a version is listed beside its publisher, before its wire shards are on its
    server (`publish_stream`): the woken relay finds nothing new, reads the lists again every EAGER_POLL_S, and
    mirrors the version once it is whole, long before its own poll (60 s here) comes round."""
    from shardcast.codec import flatten
    from shardcast.publish import publish_stream

    async def go():
        origin, origin_url = await sc.serve(origin_store)
        relay_store = Store(tmp_path / "relay")
        stop, wake = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        seen: list[list[int]] = []  # each version list the relay read upstream
        progress = asyncio.Condition()  # notified each time the relay read a list or mirrored a version
        try:
            async with Fetcher(relay_store, [origin_url], trusted) as upstream:
                real_versions, real_fetch = upstream.versions, upstream.fetch

                async def versions(run_id):
                    got = await real_versions(run_id)
                    async with progress:
                        seen.append(got)
                        progress.notify_all()
                    return got

                async def fetch(*args, **kwargs):
                    got = await real_fetch(*args, **kwargs)
                    async with progress:
                        progress.notify_all()
                    return got

                upstream.versions, upstream.fetch = versions, fetch
                task = asyncio.create_task(mirror(upstream, "run", poll_s=60.0, stop=stop, wake=wake))
                async with progress:
                    await progress.wait_for(lambda: relay_store.complete_versions("run") == [0])
                tensors, payload = flatten(sc.rl_step(sc.make_state(0), 1))

                woken: list[list[int]] = []

                async def announced():  # the gossip announcement, then the relay's round before the wire shards
                    async with progress:
                        before = len(seen)
                        wake.set()
                        await progress.wait_for(lambda: len(seen) > before)
                        woken.append(seen[before])

                def on_signed(_local):
                    asyncio.run_coroutine_threadsafe(announced(), loop).result(30)

                await asyncio.to_thread(publish_stream, origin_store, key, "run", 1, tensors, payload,
                                        iter([len(payload)]), 0, PublishOptions(shard_size=sc.SHARD), on_signed)
                assert woken == [[0]]  # the woken round found nothing new: v1's wire shards were not listed yet
                async with progress:  # long before its 60 s poll
                    await asyncio.wait_for(progress.wait_for(lambda: relay_store.complete_versions("run") == [0, 1]), 20)
                stop.set()
                await asyncio.wait_for(task, 10)
        finally:
            await origin.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_busy_source_answers_503_and_clients_still_finish(tmp_path, origin_store, trusted, sc):
    """A server with one upload slot turns extra requests away; busy is not broken: no source is
    dropped and every client completes."""
    async def go():
        server, url = await sc.serve(origin_store, max_concurrent=1, queue_timeout=0.01, uplink_bytes_per_s=8 << 20)
        try:
            async def one(i):
                async with Fetcher(Store(tmp_path / f"c{i}"), [url], trusted, parallel=4) as f:
                    got = await f.fetch("run", 0)
                    return got, f.pool.sources[0]
            return await asyncio.gather(*(one(i) for i in range(3))), server.busy_refusals
        finally:
            await server.stop()

    results, refusals = asyncio.run(go())
    assert refusals > 0, "the single slot was contended"
    for got, source in results:
        sc.assert_same(got.tensors(), sc.make_state(0))
        assert source.dropped is None and source.failures == 0


def test_relay_stops_at_once_while_upstream_stalls(tmp_path, trusted):
    """SIGTERM during a mirror round must not wait on a silent upstream (found by CI: a relay
    mid-fetch when the trainer exited took > 20 s to stop and was SIGKILLed)."""
    async def go():
        async def silent(reader, writer):  # accepts, reads, never answers
            await reader.read(65536)
            await asyncio.sleep(3600)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        stop = asyncio.Event()
        try:
            async with Fetcher(Store(tmp_path / "relay"), [url], trusted, stall_timeout=60) as upstream:
                task = asyncio.create_task(mirror(upstream, "run", poll_s=0.1, stop=stop))
                await asyncio.sleep(0.5)
                assert not task.done(), "the round is waiting on the silent upstream"
                t0 = asyncio.get_running_loop().time()
                stop.set()
                await asyncio.wait_for(task, 5)
                return asyncio.get_running_loop().time() - t0
        finally:
            server.close()

    assert asyncio.run(go()) < 1.0
