"""Every byte is checked against a signed manifest; a lying or broken source costs a refetch."""

import asyncio

import pytest

from protocol.identity import NodeKey
from shardcast.errors import FetchFailed, InvalidManifest, InvalidSignature, UnknownPublisher
from shardcast.fetch import Fetcher, fetch_version
from shardcast.manifest import SignedManifest, TrustedPublishers
from shardcast.store import Store


def _fetch_with(tmp_path, origin_store, trusted, sc, mode, with_honest=True, **kw):
    async def go():
        bad = sc.HostileSource(origin_store, mode)
        bad_url = await bad.start()
        server, good_url = await sc.serve(origin_store)
        try:
            sources = [bad_url] + ([good_url] if with_honest else [])
            async with Fetcher(Store(tmp_path / "client"), sources, trusted, **kw) as f:
                got = await f.fetch("run", 0)
                return got, f.pool, bad
        finally:
            await bad.stop()
            await server.stop()

    return asyncio.run(go())


def test_honest_fetch_reproduces_the_published_tensors(tmp_path, origin_store, trusted, sc):
    got, pool, honest = _fetch_with(tmp_path, origin_store, trusted, sc, "honest", with_honest=False)
    sc.assert_same(got.tensors(), sc.make_state(0))
    assert honest.shard_requests == len(got.manifest.shards) and pool.sources[0].dropped is None


@pytest.mark.parametrize("mode", ["corrupt", "truncate", "short"])
def test_bad_shard_is_detected_and_refetched_from_another_source(tmp_path, origin_store, trusted, sc, mode):
    got, pool, bad = _fetch_with(tmp_path, origin_store, trusted, sc, mode)
    sc.assert_same(got.tensors(), sc.make_state(0))
    assert bad.shard_requests >= 1, "the hostile source was never tried"
    liar = pool.sources[0]
    assert liar.dropped is not None and ("hash" in liar.dropped or "of" in liar.dropped or "cut" in liar.dropped)


def test_stalled_source_is_dropped_and_shards_fetched_elsewhere(tmp_path, origin_store, trusted, sc):
    got, pool, bad = _fetch_with(tmp_path, origin_store, trusted, sc, "stall", stall_timeout=0.5)
    sc.assert_same(got.tensors(), sc.make_state(0))
    assert bad.shard_requests >= 1 and pool.sources[1].bytes_received > 0


def test_only_corrupt_sources_end_in_a_clear_error_after_bounded_retries(tmp_path, origin_store, trusted, sc):
    with pytest.raises(FetchFailed, match="every source dropped|failed"):
        _fetch_with(tmp_path, origin_store, trusted, sc, "corrupt", with_honest=False, max_attempts=3)
    assert not Store(tmp_path / "client").complete_versions("run"), "nothing unverified may be kept"


def test_tampered_manifest_is_refused_with_invalid_signature(tmp_path, origin_store, trusted, sc):
    with pytest.raises(InvalidSignature):
        _fetch_with(tmp_path, origin_store, trusted, sc, "manifest", with_honest=False)


def test_tampered_manifest_source_is_dropped_and_honest_one_used(tmp_path, origin_store, trusted, sc):
    got, pool, _ = _fetch_with(tmp_path, origin_store, trusted, sc, "manifest")
    sc.assert_same(got.tensors(), sc.make_state(0))
    assert "bad manifest" in (pool.sources[0].dropped or "")


def test_manifest_from_unknown_publisher_is_refused(tmp_path, origin_store, sc):
    stranger = TrustedPublishers([NodeKey.from_seed(b"\x02" * 32).peer_id])

    async def go():
        server, url = await sc.serve(origin_store)
        try:
            await fetch_version(Store(tmp_path / "c"), [url], stranger, "run", 0)
        finally:
            await server.stop()

    with pytest.raises(UnknownPublisher):
        asyncio.run(go())


def test_inconsistent_or_malformed_manifest_is_invalid(origin_store, key):
    signed = origin_store.manifest("run", 0)
    assert signed is not None and signed.verified(TrustedPublishers([key.public_bytes])).version == 0
    doc = signed.model_dump(mode="json")
    doc["manifest"]["shards"][0]["raw_size"] += 1  # sizes no longer tile the payload
    import json

    with pytest.raises(InvalidManifest):
        SignedManifest.from_json(json.dumps(doc))
    with pytest.raises(InvalidManifest):
        SignedManifest.from_json(b"{not json")


def test_server_refuses_path_tricks_and_missing_shards(origin_store, sc):
    import aiohttp

    async def go():
        server, url = await sc.serve(origin_store)
        try:
            async with aiohttp.ClientSession() as s:
                codes = []
                for path in ["..%2F..%2Fetc/0/manifest", "run/0/shard/99999", "run/x/have", "run/0/shard/0"]:
                    async with s.get(f"{url}/shardcast/{path}") as r:
                        codes.append(r.status)
                async with s.get(f"{url}/shardcast/run/0/shard/0", headers={"Range": "bytes=10-19"}) as r:
                    ranged = (r.status, len(await r.read()))
                return codes, ranged
        finally:
            await server.stop()

    codes, ranged = asyncio.run(go())
    assert codes[0] in (400, 404) and codes[1] == 404 and codes[2] == 400 and codes[3] == 200
    assert ranged == (206, 10)


def test_a_liar_stays_dropped_for_later_versions_while_a_stalled_source_gets_another_chance():
    from shardcast.sources import SourcePool

    pool = SourcePool.of(["http://liar", "http://flaky", "http://fine"])
    liar, flaky, fine = pool.sources
    liar.drop("wire bytes do not match the manifest hash", lied=True)
    flaky.fail("stalled")
    flaky.fail("stalled")
    assert [s.url for s in pool.alive()] == ["http://fine"]
    pool.new_version()
    assert [s.url for s in pool.alive()] == ["http://flaky", "http://fine"] and flaky.failures == 0


def test_corrupt_source_is_not_asked_again_for_the_next_version(tmp_path, origin_store, key, trusted, sc):
    from shardcast.publish import PublishOptions, publish

    async def go():
        bad = sc.HostileSource(origin_store, "corrupt")
        bad_url = await bad.start()
        server, good_url = await sc.serve(origin_store)
        try:
            async with Fetcher(Store(tmp_path / "client"), [bad_url, good_url], trusted) as f:
                await f.fetch("run", 0)
                asked = bad.shard_requests
                publish(origin_store, key, "run", 1, sc.rl_step(sc.make_state(0), 1), parent=0, options=PublishOptions(shard_size=sc.SHARD))
                got = await f.fetch("run", 1)
                return asked, bad.shard_requests, got
        finally:
            await bad.stop()
            await server.stop()

    asked_v0, asked_total, got = asyncio.run(go())
    assert asked_v0 >= 1 and asked_total == asked_v0
    sc.assert_same(got.tensors(), sc.rl_step(sc.make_state(0), 1))


def test_fetch_pinned_to_an_announced_manifest_hash(tmp_path, origin_store, trusted, sc):
    announced = origin_store.manifest("run", 0).manifest.manifest_hash()

    async def go(pin):
        server, url = await sc.serve(origin_store)
        try:
            async with Fetcher(Store(tmp_path / f"c{pin[:4]}"), [url], trusted) as f:
                return await f.fetch("run", 0, manifest_hash=pin)
        finally:
            await server.stop()

    sc.assert_same(asyncio.run(go(announced)).tensors(), sc.make_state(0))
    with pytest.raises(InvalidManifest, match="announced"):
        asyncio.run(go("0" * 64))
