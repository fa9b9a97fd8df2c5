"""A streamed version is listed beside its publisher before its wire shards are encoded
(`shardcast.publish.publish_stream`, step 1: the payload and a signed local manifest), so a process sharing
the store reads it at once, under the hash the coordinator announces; peers elsewhere are told it is not there
until the wire shards and the whole manifest are (step 2), then fetch it bit for bit. A source that serves a
manifest without wire fields is refused as lying."""

import asyncio
import os
import sys

import pytest

from shardcast.codec import flatten
from shardcast.errors import InvalidManifest, InvalidSignature, VersionNotFound
from shardcast.fetch import Fetcher
from shardcast.manifest import SignedManifest
from shardcast.publish import PublishOptions, publish_stream
from shardcast.store import Store


def _stream(store, key, sc, v, state, on_signed=None):
    tensors, payload = flatten(state)
    filled = iter([len(payload) // 2, len(payload)])
    return publish_stream(store, key, "run", v, tensors, payload, filled, v - 1 if v else None,
                          PublishOptions(shard_size=sc.SHARD, threads=2), on_signed=on_signed)


def test_a_version_is_read_beside_its_publisher_before_its_wire_shards_and_fetched_elsewhere_after(tmp_path, key,
                                                                                                   trusted, sc):
    states = [sc.make_state(0), sc.rl_step(sc.make_state(0), 1)]
    trainer = Store(tmp_path / "trainer")
    _stream(trainer, key, sc, 0, states[0])
    seen = {}

    async def body():
        server, url = await sc.serve(trainer)
        loop = asyncio.get_running_loop()

        async def while_listed_locally(local: SignedManifest):
            seen["local"] = local
            seen["whole_yet"] = trainer.manifest("run", 1) is not None
            seen["wire_shards_yet"] = trainer.held_shards("run", 1)
            async with Fetcher(trainer, [url], trusted) as beside:  # a role sharing the trainer's store
                seen["beside"] = (await beside.fetch("run", 1, local.manifest.manifest_hash())).tensors()
            async with Fetcher(Store(tmp_path / "elsewhere-early"), [url], trusted) as elsewhere:
                with pytest.raises(VersionNotFound):
                    await elsewhere.fetch("run", 1)

        def on_signed(local):  # called on the publishing thread: step 2 waits for the checks
            asyncio.run_coroutine_threadsafe(while_listed_locally(local), loop).result(60)

        try:
            whole = await asyncio.to_thread(_stream, trainer, key, sc, 1, states[1], on_signed)
            async with Fetcher(Store(tmp_path / "elsewhere"), [url], trusted) as elsewhere:
                got = (await elsewhere.fetch("run", 1, seen["local"].manifest.manifest_hash())).tensors()
            return whole, got
        finally:
            await server.stop()

    whole, got = asyncio.run(asyncio.wait_for(body(), 120))
    local = seen["local"].manifest
    assert not local.wire_complete and not seen["whole_yet"] and seen["wire_shards_yet"] == []
    sc.assert_same(seen["beside"], states[1])
    assert whole.manifest.wire_complete and whole.manifest.encoding == "delta"
    assert whole.manifest.manifest_hash() == local.manifest_hash()  # what the coordinator announced
    assert [(s.raw_size, s.raw_hash) for s in whole.manifest.shards] == [(s.raw_size, s.raw_hash) for s in local.shards]
    sc.assert_same(got, states[1])


def test_the_signature_covers_the_wire_fields_the_announced_hash_leaves_out(tmp_path, key, trusted, sc):
    store = Store(tmp_path / "s")
    whole = _stream(store, key, sc, 0, sc.make_state(0))
    shards = list(whole.manifest.shards)
    shards[0] = shards[0].model_copy(update={"wire_hash": "0" * 64})
    forged = whole.model_copy(update={"manifest": whole.manifest.model_copy(update={"shards": shards})})
    assert forged.manifest.manifest_hash() == whole.manifest.manifest_hash()
    with pytest.raises(InvalidSignature):
        forged.verified(trusted)
    assert whole.verified(trusted) == whole.manifest


def test_a_source_serving_a_manifest_without_wire_fields_is_refused(tmp_path, key, trusted, sc):
    origin = Store(tmp_path / "origin")
    locals_ = []
    _stream(origin, key, sc, 0, sc.make_state(0), on_signed=locals_.append)
    # a lying source: the signed local manifest where the whole one belongs
    origin.manifest_path("run", 0).write_bytes(locals_[0].to_json())

    async def body():
        source = sc.HostileSource(origin, "honest")
        url = await source.start()
        try:
            async with Fetcher(Store(tmp_path / "follower"), [url], trusted) as f:
                with pytest.raises(InvalidManifest, match="no wire shards"):
                    await f.fetch("run", 0)
        finally:
            await source.stop()

    asyncio.run(asyncio.wait_for(body(), 60))


@pytest.mark.parametrize("keyframe_every", [1, 8])
def test_a_version_whose_wire_shards_failed_goes_once_a_newer_one_is_whole_unless_a_delta_needs_it(
        tmp_path, key, sc, monkeypatch, keyframe_every):
    import shardcast.publish as publish

    real = publish._publish_wire

    def wire(store_, key_, local, opt):  # step 2 of v1 fails (a full disk, a crash between the steps)
        if local.version == 1:
            raise OSError(28, "No space left on device")
        return real(store_, key_, local, opt)

    monkeypatch.setattr(publish, "_publish_wire", wire)
    store = Store(tmp_path / "s")
    opts = PublishOptions(shard_size=sc.SHARD, threads=2, keep_last=2, keyframe_every=keyframe_every)

    def stream(v, on_signed=None):
        tensors, payload = flatten(sc.rl_step(sc.make_state(0), v))
        return publish_stream(store, key, "run", v, tensors, payload, iter([len(payload)]), v - 1 if v else None,
                              opts, on_signed=on_signed)

    stream(0)
    with pytest.raises(OSError):
        stream(1)
    assert store.manifest("run", 1) is None and store.held_manifest("run", 1) is not None  # listed locally only
    during = []  # another process's retention while v2 is listed locally, its wire shards not yet encoded
    whole = stream(2, on_signed=lambda local: during.append(Store(store.root).retain("run", keep_last=1)))
    assert during == [[]] and whole.manifest.wire_complete  # v2 in its step 2 was left alone, v1 then newest too
    if keyframe_every == 1:  # v2 is a keyframe: v1 is stranded, and goes with v2's own retention
        assert not store.version_dir("run", 1).exists() and store.held_manifest("run", 1) is None
    else:  # v2 is a delta against v1's payload: v1 stays while v2 is kept
        assert whole.manifest.parent == 1 and store.version_dir("run", 1).exists()
    assert store.versions("run") == [0, 2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread niceness is Linux's")
def test_wire_shards_are_encoded_at_a_lower_priority_than_the_listing_and_the_caller(tmp_path, key, sc, monkeypatch):
    """Step 2 runs after the announcement, beside roles of this host that read the version (a node staging it):
    its threads yield to them (`PublishOptions.wire_nice`); step 1, which the announcement waits for, and the
    caller keep the process's priority, and `wire_nice=0` leaves step 2 there too."""
    import threading

    import shardcast.publish as publish

    seen: dict[str, set[int]] = {"hash": set(), "encode": set()}
    real_hash, real_encode = publish.content_hash, publish.encode_shard

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def hashing(data):
        seen["hash"].add(niceness())
        return real_hash(data)

    def encoding(*args, **kwargs):
        seen["encode"].add(niceness())
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(publish, "content_hash", hashing)
    monkeypatch.setattr(publish, "encode_shard", encoding)
    own = niceness()
    state = sc.make_state(0)
    for v, nice in ((0, 10), (1, 0)):
        seen = {"hash": set(), "encode": set()}
        tensors, payload = flatten(state)
        signed = publish_stream(Store(tmp_path / f"s{v}"), key, "run", v, tensors, payload, iter([len(payload)]), None,
                                PublishOptions(shard_size=sc.SHARD, threads=2, wire_nice=nice))
        assert signed.manifest.wire_complete and len(signed.manifest.shards) > 1
        assert seen["hash"] == {own}
        assert seen["encode"] == {min(19, own + nice)}
    assert niceness() == own
