"""Delta chains rebuild bit-exactly; keyframes bound the chain; retention keeps what is needed."""

import asyncio
import logging

from shardcast.fetch import Fetcher
from shardcast.publish import PublishOptions, publish
from shardcast.store import Store


def _publish_chain(store, key, sc, n, keyframe_every, keep_last=100):
    states, s = [], sc.make_state(0)
    opts = PublishOptions(shard_size=sc.SHARD, keyframe_every=keyframe_every, keep_last=keep_last)
    for v in range(n):
        if v:
            s = sc.rl_step(s, v)
        states.append(s)
        publish(store, key, "run", v, s, parent=v - 1 if v else None, options=opts)
    return states


def test_delta_round_trip_is_bit_exact_over_a_chain_with_keyframes(tmp_path, key, trusted, sc):
    origin = Store(tmp_path / "origin")
    states = _publish_chain(origin, key, sc, n=7, keyframe_every=3)
    kinds = [(origin.manifest("run", v).manifest.encoding, origin.manifest("run", v).manifest.keyframe) for v in range(7)]
    assert kinds == [("full", 0), ("delta", 0), ("delta", 0), ("full", 3), ("delta", 3), ("delta", 3), ("full", 6)]
    full = origin.manifest("run", 3).manifest.wire_bytes
    assert origin.manifest("run", 4).manifest.wire_bytes < full / 2, "a small update must make a small delta"

    async def go():
        server, url = await sc.serve(origin)
        try:
            # A node that follows every version, and a late joiner that wants v5 only.
            async with Fetcher(Store(tmp_path / "follower"), [url], trusted) as f:
                followed = [(await f.fetch("run", v)).tensors() for v in range(7)]
            late_store = Store(tmp_path / "late")
            async with Fetcher(late_store, [url], trusted) as f:
                late = (await f.fetch("run", 5)).tensors()
            return followed, late, late_store.complete_versions("run")
        finally:
            await server.stop()

    followed, late, late_held = asyncio.run(go())
    for v in range(7):
        sc.assert_same(followed[v], states[v])
    sc.assert_same(late, states[5])
    assert late_held == [3, 4, 5], "a late joiner replays only from the last keyframe"


def test_delta_shard_verified_against_full_version_hashes(tmp_path, key, sc):
    """Decoding a delta against the wrong parent is caught by the full version's raw hash."""
    import numpy as np
    import pytest

    from shardcast.codec import decode_shard
    from shardcast.errors import CorruptShard

    origin = Store(tmp_path / "origin", keep_payloads=3)  # this test reads old payloads
    _publish_chain(origin, key, sc, n=3, keyframe_every=8)
    m2 = origin.manifest("run", 2).manifest
    e = m2.shards[0]
    wire = origin.read_shard("run", 2, 0)
    out = np.empty(e.raw_size, dtype=np.uint8)
    decode_shard(e, wire, out, np.asarray(origin.payload("run", 1)[: e.raw_size]))  # right parent: fine
    with pytest.raises(CorruptShard, match="full version"):
        decode_shard(e, wire, out, np.asarray(origin.payload("run", 0)[: e.raw_size]))


def test_retention_deletes_only_old_versions_and_keeps_the_keyframe_chain(tmp_path, key, sc, caplog):
    store = Store(tmp_path / "origin")
    _publish_chain(store, key, sc, n=9, keyframe_every=4, keep_last=3)
    # v8 is a keyframe, v6,v7 deltas on keyframe v4: keep 6,7,8 plus 4,5 they need; 0..3 go.
    assert store.versions("run") == [4, 5, 6, 7, 8]
    for v in store.versions("run"):
        assert len(store.held_shards("run", v)) == len(store.manifest("run", v).manifest.shards)
    # decoded payloads only for the newest two (the next delta's parent and one behind); wire shards for all
    assert [v for v in store.versions("run") if store.payload_path("run", v).exists()] == [7, 8]
    assert store.complete_versions("run") == [4, 5, 6, 7, 8]
    assert not (tmp_path / "origin" / "run" / "00000003").exists()
    with caplog.at_level(logging.INFO, logger="shardcast.store"):
        assert store.retain("run", keep_last=1) == [4, 5, 6, 7], "a keyframe alone needs nothing older"
    assert store.versions("run") == [8]
    # one line for the versions a retention pass deletes (the walk-through: a burst of 8 lines)
    assert [r.getMessage() for r in caplog.records if "retention" in r.getMessage()] == [
        "retention: deleted run v4, v5, v6, v7"]


def test_layout_change_forces_a_full_version(tmp_path, key, sc):
    store = Store(tmp_path / "o")
    opts = PublishOptions(shard_size=sc.SHARD)
    publish(store, key, "run", 0, sc.make_state(0), options=opts)
    grown = dict(sc.make_state(1))
    grown["lm_head.weight"] = sc.make_state(2)["model.embed_tokens.weight"]
    publish(store, key, "run", 1, grown, parent=0, options=opts)
    assert store.manifest("run", 1).manifest.encoding == "full"


def test_streamed_publication_makes_the_versions_publish_makes(tmp_path, key, trusted, sc):
    """`publish_stream` (the trainer's call: the payload final in steps, shards encoded as their range is
    final) writes the same wire shards, hashes and payload file as `publish`, and a follower rebuilds its
    chain bit-exactly."""
    import numpy as np

    from shardcast.codec import flatten
    from shardcast.publish import publish_stream

    states, s = [], sc.make_state(0)
    for v in range(3):
        s = sc.rl_step(s, v) if v else s
        states.append(s)
    streamed, whole = Store(tmp_path / "streamed"), Store(tmp_path / "whole")
    opts = PublishOptions(shard_size=sc.SHARD, threads=2)
    for v, state in enumerate(states):
        tensors, payload = flatten(state)
        filled = iter([len(payload) // 3, 2 * len(payload) // 3, len(payload)])  # as the device-to-host copy reports
        publish_stream(streamed, key, "run", v, tensors, payload, filled, v - 1 if v else None, opts)
        publish(whole, key, "run", v, state, parent=v - 1 if v else None, options=opts)
    for v in range(3):
        a, b = streamed.manifest("run", v).manifest, whole.manifest("run", v).manifest
        assert a.encoding == b.encoding == ("delta" if v else "full")
        assert [e.model_dump() for e in a.shards] == [e.model_dump() for e in b.shards]
        assert not list(streamed.version_dir("run", v).glob(".*.tmp")), "no temporary file left behind"
    assert np.array_equal(streamed.payload("run", 2), flatten(states[2])[1])
    from shardcast.retention import drop_payload

    # the payload is a file per shard (retention kept the newest two), and dropped as a whole
    assert [v for v in range(3) if streamed.payload_dir("run", v).is_dir()] == [1, 2]
    assert drop_payload(streamed, "run", 1) and not streamed.payload_path("run", 1).exists()

    async def go():
        server, url = await sc.serve(streamed)
        try:
            async with Fetcher(Store(tmp_path / "follower"), [url], trusted) as f:
                return [(await f.fetch("run", v)).tensors() for v in range(3)]
        finally:
            await server.stop()

    for got, want in zip(asyncio.run(go()), states):
        sc.assert_same(got, want)
