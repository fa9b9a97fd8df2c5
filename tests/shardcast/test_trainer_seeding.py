"""Super-seeding in the roles: the recipe's `super_seed_copies` makes the trainer's origin hand each
shard out that many times (then 425, hidden from /have), and makes relays mirror from each other
as well as the trainer, so the hidden shards still reach everyone. With no relay in the spec the
trainer serves every request (seeding would leave nodes nobody to fetch from)."""

import asyncio

import aiohttp
import pytest

from node.recipe import InvalidRecipe, Recipe
from node.roles.relay import mirror_sources
from node.roles.trainer import origin_server
from protocol.identity import NodeKey
from protocol.messages import RunSpec

TRAINER, RELAY1, RELAY2 = "http://127.0.0.1:8470", "http://127.0.0.1:8471", "http://127.0.0.1:8472"
CK = NodeKey.from_seed(b"\x02" * 32)


def _spec(sources: list[str], **recipe) -> RunSpec:
    return RunSpec(run_id="run", coordinator=CK.peer_id, shardcast_sources=sources, recipe=recipe)


def test_relays_trade_with_each_other_only_when_the_trainer_super_seeds():
    plain, seeded = _spec([TRAINER, RELAY1, RELAY2]), _spec([TRAINER, RELAY1, RELAY2], super_seed_copies=1)
    assert mirror_sources(plain, "127.0.0.1", 8471) == [TRAINER]
    assert mirror_sources(seeded, "127.0.0.1", 8471) == [TRAINER, RELAY2]
    assert mirror_sources(seeded, "127.0.0.1", 8472) == [TRAINER, RELAY1]


def test_super_seed_copies_is_bounded():
    assert Recipe.parse({"super_seed_copies": 2}).super_seed_copies == 2
    with pytest.raises(InvalidRecipe):
        Recipe.parse({"super_seed_copies": -1})


def test_trainer_origin_seeds_only_with_relays_to_spread_the_shards(tmp_path, origin_store, caplog):
    assert origin_server(origin_store, _spec([TRAINER, RELAY1], super_seed_copies=2), "127.0.0.1", 8470).seed.copies == 2
    assert origin_server(origin_store, _spec([TRAINER, RELAY1]), "127.0.0.1", 8470).seed is None
    assert origin_server(origin_store, _spec([TRAINER], super_seed_copies=1), "127.0.0.1", 8470).seed is None
    assert "no relay" in caplog.text


def test_trainer_origin_hands_each_shard_out_once_then_425(origin_store):
    async def go():
        server = origin_server(origin_store, _spec([TRAINER, RELAY1], super_seed_copies=1), "127.0.0.1", 8470)
        port = await server.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}/shardcast/run/0"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                async def status(path: str) -> int:
                    async with s.get(f"{base}/{path}") as r:
                        await r.read()
                        return r.status

                async def have() -> list[int]:
                    async with s.get(f"{base}/have") as r:
                        return (await r.json())["shards"]

                held = await have()
                first = await status("shard/0")
                again = await status("shard/0")
                other = await status("shard/1")
                last_resort = await status("shard/0?last_resort=1")
                return held, first, again, other, last_resort, await have()
        finally:
            await server.stop()

    held, first, again, other, last_resort, after = asyncio.run(go())
    assert 0 in held and 1 in held
    assert (first, again, other, last_resort) == (200, 425, 200, 200)
    assert 0 not in after and 1 not in after and set(after) == set(held) - {0, 1}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_super_seeding_trainer_and_two_relays_get_a_version_to_a_node_for_about_one_copy(tmp_path, origin_store, trusted, sc):
    """The roles' pieces together, over real servers: the trainer's origin (from the recipe), two
    relays mirroring from `mirror_sources` (each other too), a node listing all three."""
    from shardcast.fetch import Fetcher
    from shardcast.relay import mirror
    from shardcast.server import ShardServer
    from shardcast.store import Store

    ports = [_free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    spec = _spec(urls, super_seed_copies=1)
    wire = origin_store.manifest("run", 0).manifest.wire_bytes

    async def go():
        origin = origin_server(origin_store, spec, "127.0.0.1", ports[0])
        await origin.start("127.0.0.1", ports[0])
        relays = []
        stop = asyncio.Event()
        tasks = []
        try:
            for i in (1, 2):
                store = Store(tmp_path / f"relay{i}")
                server = ShardServer(store)
                await server.start("127.0.0.1", ports[i])
                fetcher = await Fetcher(store, mirror_sources(spec, "127.0.0.1", ports[i]), trusted).__aenter__()
                relays.append((store, server, fetcher))
                tasks.append(asyncio.create_task(mirror(fetcher, "run", poll_s=0.2, stop=stop)))
            for _ in range(1000):
                if all(s.complete_versions("run") == [0] for s, _, _ in relays):
                    break
                await asyncio.sleep(0.02)
            async with Fetcher(Store(tmp_path / "node"), urls, trusted) as f:
                got = await f.fetch("run", 0)
            return got, origin.bytes_served, [s.complete_versions("run") for s, _, _ in relays]
        finally:
            stop.set()
            for t in tasks:
                await asyncio.wait_for(t, 10)
            for _, server, fetcher in relays:
                await fetcher.__aexit__(None, None, None)
                await server.stop()
            await origin.stop()

    got, origin_sent, relay_held = asyncio.run(go())
    sc.assert_same(got.tensors(), sc.make_state(0))
    assert relay_held == [[0], [0]]
    # Relays that list only the trainer (as without seeding) got the hidden shards by last-resort
    # requests: the origin sent 2.0x the version (measured by reverting mirror_sources).
    assert wire <= origin_sent < 1.5 * wire, (origin_sent, wire)
