"""Super-seeding origin and the fetch policy that goes with it: the origin hands each shard out
once, peers spread it, a node whose only copy-holder vanished still finishes (last resort), and
the policy is the same code under a simulated clock (the swarm simulator drives it)."""

from __future__ import annotations

import asyncio
import shutil

from shardcast.fetch import fetch_version
from shardcast.publish import PublishOptions, publish
from shardcast.seeding import SeedOffer
from shardcast import sources
from shardcast.sources import STARVE_S, Outcome, ShardSchedule, SourcePool
from shardcast.store import Store


def test_seed_offer_hides_a_handed_out_shard_unless_last_resort():
    offer = SeedOffer(copies=1)
    assert offer.offered("r", 1, [0, 1, 2]) == [0, 1, 2]
    assert offer.admit("r", 1, 1, last_resort=False)
    assert offer.offered("r", 1, [0, 1, 2]) == [0, 2]
    assert not offer.admit("r", 1, 1, last_resort=False)
    assert offer.admit("r", 1, 1, last_resort=True)
    assert offer.offered("r", 2, [0, 1, 2]) == [0, 1, 2]  # a new version starts afresh


def test_schedule_under_a_simulated_clock_starves_then_asks_the_seed_as_last_resort():
    now = [0.0]
    pool = SourcePool.of(["http://origin", "http://peer"], clock=lambda: now[0])
    origin, peer = pool.sources
    origin.seed, origin.have, peer.have = True, set(), set()  # the origin hides shard 0; no peer has it
    plan = ShardSchedule(pool, {0}, parallel=4)
    assert plan.next() is None
    now[0] = STARVE_S / 2
    assert plan.next() is None  # not starving long enough yet
    now[0] = STARVE_S + 0.01
    src, i, last_resort = plan.next()
    assert (src, i, last_resort) == (origin, 0, True)
    plan.failed(src, i, Outcome.NOT_OFFERED, "425")
    assert plan.attempts.get(0, 0) == 0 and plan.error is None and origin.dropped is None  # no penalty
    peer.have.add(0)
    src, i, last_resort = plan.next()
    assert (src.url, last_resort) == ("http://peer", False)
    plan.succeeded(src, i, 100, 0.5)
    assert plan.done and plan.error is None and peer.throughput == 200


def test_two_peers_behind_a_super_seeding_origin_get_each_shard_from_it_about_once(tmp_path, key, trusted, sc):
    origin = Store(tmp_path / "origin")
    publish(origin, key, "run", 0, sc.make_state(0), options=PublishOptions(shard_size=sc.SHARD))
    wire = origin.manifest("run", 0).manifest.wire_bytes

    async def go():
        server, url = await sc.serve(origin, seed=SeedOffer(1))
        stores = [Store(tmp_path / f"peer{j}") for j in range(2)]
        peers = [await sc.serve(s) for s in stores]
        try:
            got = await asyncio.gather(*(fetch_version(s, [url, peers[1 - j][1]], trusted, "run", 0) for j, s in enumerate(stores)))
            for g in got:
                sc.assert_same(g.tensors(), sc.make_state(0))
            # Each shard handed out once, plus a few last-resort copies at most.
            assert server.bytes_served < 1.5 * wire, (server.bytes_served, wire)
            assert sum(p.bytes_served for p, _ in peers) > 0.4 * wire
        finally:
            for p, _ in peers:
                await p.stop()
            await server.stop()

    asyncio.run(go())


def test_node_finishes_when_the_peer_that_got_the_only_copies_is_gone(tmp_path, key, trusted, sc):
    origin = Store(tmp_path / "origin")
    publish(origin, key, "run", 0, sc.make_state(0), options=PublishOptions(shard_size=sc.SHARD))

    async def go():
        server, url = await sc.serve(origin, seed=SeedOffer(1))
        first = Store(tmp_path / "first")
        peer, peer_url = await sc.serve(first)
        try:
            await fetch_version(first, [url], trusted, "run", 0)  # takes every shard's one copy
            await peer.stop()
            shutil.rmtree(first.root)  # and leaves with them
            got = await fetch_version(Store(tmp_path / "late"), [url, peer_url], trusted, "run", 0)
            sc.assert_same(got.tensors(), sc.make_state(0))
        finally:
            await server.stop()

    asyncio.run(go())


def test_waiting_on_a_source_that_is_fetching_is_not_a_stuck_fetch():
    """A node behind relays still pulling their first big shards must not give up after 30 s;
    with nothing held or being fetched anywhere it must."""
    now = [0.0]
    pool = SourcePool.of(["http://relay"], clock=lambda: now[0])
    relay = pool.sources[0]
    relay.have, relay.fetching = set(), {0}
    plan = ShardSchedule(pool, {0, 1}, parallel=4)
    now[0] = sources.NO_HOLDER_TIMEOUT_S * 3
    assert plan.next() is None and plan.error is None
    relay.fetching = set()
    now[0] += sources.NO_HOLDER_TIMEOUT_S + 1
    assert plan.next() is None and "no live source holds" in (plan.error or "")
