"""A flooding peer meets its bounds, and the honest peer next to it is still served.

Real libp2p hosts, a real coordinator service, a real aiohttp shard server; the flooder on HTTP
connects from 127.0.0.2 so that it is a different client than the honest one (127.0.0.1).
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from protocol.coordinator import Coordinator
from protocol.errors import TransportError
from protocol.identity import NodeKey
from protocol.limits import LimitConfig, PeerLimiter
from protocol.messages import Join, LeaseBatchRequest, LeaseGrants, RunSpec
from protocol import pipeline
from protocol.transport import PeerHost
from protocol_testnet import make_spec, run, start_coordinator, start_member, stop_all
from shardcast.publish import PublishOptions, publish
from shardcast.server import ShardServer
from shardcast.store import Store


def test_peer_limiter_holds_every_bound_and_admits_an_honest_pace():
    lim = PeerLimiter(LimitConfig(rate_per_s=10, burst=5, max_inflight=3, max_bytes_inflight=100, max_total_inflight=4))
    # rate: a burst of 5, then one token per 0.1 s
    got = [lim.admit("a", now=0.0) and (lim.release("a") or True) for _ in range(8)]
    assert got == [True] * 5 + [False] * 3
    assert lim.admit("a", now=0.1) and lim.release("a") is None
    # in flight per peer, and over all peers
    assert [lim.admit("b", now=10.0) for _ in range(4)] == [True, True, True, False]
    assert lim.admit("c", now=10.0) and not lim.admit("d", now=10.0)  # total of 4 reached
    # bytes in flight
    assert lim.reserve_bytes("b", 60) and not lim.reserve_bytes("b", 60)
    lim.release("b", 60)
    assert lim.reserve_bytes("b", 60)
    # an honest peer at its rate is never refused
    honest = PeerLimiter(LimitConfig(rate_per_s=10, burst=5))
    assert all(honest.admit("h", now=i * 0.1) and (honest.release("h") or True) for i in range(100))
    assert honest.refused == 0


def test_flooding_libp2p_peer_is_bounded_while_an_honest_peer_is_served():
    async def body():
        server = PeerHost(NodeKey.generate(), limits=LimitConfig(max_inflight=4))
        flooder, honest = PeerHost(NodeKey.generate()), PeerHost(NodeKey.generate())
        for h in (server, flooder, honest):
            await h.start()
        active: dict[str, int] = {}
        peak: dict[str, int] = {}

        async def slow_echo(peer: str, data: bytes) -> bytes:
            active[peer] = active.get(peer, 0) + 1
            peak[peer] = max(peak.get(peer, 0), active[peer])
            await asyncio.sleep(0.3)
            active[peer] -= 1
            return data
        server.serve("/test/echo/1", slow_echo)
        await asyncio.sleep(0.2)
        addr = f"{server.addrs[0]}/p2p/{server.peer_id}"
        await flooder.connect(addr)
        await honest.connect(addr)

        async def attempt(host: PeerHost, i: int) -> bool:
            try:
                return await host.request(server.peer_id, "/test/echo/1", b"x%d" % i, timeout=20) == b"x%d" % i
            except TransportError:
                return False
        flood = [asyncio.create_task(attempt(flooder, i)) for i in range(40)]
        await asyncio.sleep(0.1)
        honest_ok = await asyncio.gather(*[attempt(honest, i) for i in range(3)])
        flood_ok = await asyncio.gather(*flood)
        for h in (server, flooder, honest):
            await h.stop()
        return honest_ok, flood_ok, peak, server.limits.refused, flooder.peer_id, honest.peer_id
    honest_ok, flood_ok, peak, refused, fid, hid = run(body())
    assert all(honest_ok)
    assert peak[fid] <= 4 and peak[hid] >= 1
    assert refused >= 1 and flood_ok.count(False) >= 1
    assert flood_ok.count(True) >= 4  # bounded, not shut out


def _serve_one_version(tmp_path):
    key = NodeKey.from_seed(b"\x07" * 32)
    store = Store(tmp_path / "origin")
    state = {"w": torch.randn(256, 256).bfloat16()}
    publish(store, key, "r", 0, state, options=PublishOptions(shard_size=16 << 10))
    return store


def test_one_http_client_cannot_take_every_shard_slot(tmp_path):
    store = _serve_one_version(tmp_path)

    async def body():
        server = ShardServer(store, max_concurrent=4, queue_timeout=5, uplink_bytes_per_s=40_000)
        port = await server.start()
        url = f"http://127.0.0.1:{port}/shardcast/r/0/shard/0"
        flood_conn = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0), limit=0)
        async with aiohttp.ClientSession(connector=flood_conn) as flood, aiohttp.ClientSession() as honest:
            async def get(s):
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=30)) as r:
                    await r.read()
                    return r.status
            flood_tasks = [asyncio.create_task(get(flood)) for _ in range(10)]
            await asyncio.sleep(0.3)  # the flooder holds its share of slots (paced uplink)
            honest_status = await get(honest)
            flood_status = await asyncio.gather(*flood_tasks)
        await server.stop()
        return honest_status, flood_status
    honest_status, flood_status = run(body())
    assert honest_status == 200
    assert flood_status.count(503) >= 6 and flood_status.count(200) >= 1  # 2 of 4 slots per client


def test_http_request_flood_gets_429_and_others_are_still_answered(tmp_path):
    store = _serve_one_version(tmp_path)

    async def body():
        server = ShardServer(store, limits=LimitConfig(rate_per_s=5, burst=10))
        port = await server.start()
        url = f"http://127.0.0.1:{port}/shardcast/runs"
        conn = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
        async with aiohttp.ClientSession(connector=conn) as flood, aiohttp.ClientSession() as honest:
            codes = []
            for _ in range(40):
                async with flood.get(url) as r:
                    codes.append(r.status)
            async with honest.get(url) as r:
                ok = r.status, await r.json()
        await server.stop()
        return codes, ok
    codes, ok = run(body())
    assert codes[:10] == [200] * 10 and codes.count(429) >= 20
    assert ok == (200, {"runs": ["r"]})


def test_greedy_peer_cannot_take_the_whole_lease_pool(tmp_path):
    async def body():
        ck = NodeKey.generate()
        spec = make_spec(ck, batch_groups=8, max_off_policy_steps=1)
        coord = await start_coordinator(tmp_path / "c", ck, spec)
        coord.hold_s = 0.0  # empty answers at once (not held until the greedy one's short leases expire)
        addr = f"{coord.host.addrs[0]}/p2p/{ck.peer_id}"
        greedy, honest = await start_member(spec, addr), await start_member(spec, addr)
        await coord.announce_policy(0, "00" * 32)
        greedy_grants = []
        for _ in range(3):
            r = await greedy.net.request(ck.peer_id, LeaseBatchRequest(policy_version=0, count=1024))
            assert isinstance(r, LeaseGrants)
            greedy_grants += r.grants
        r = await honest.net.request(ck.peer_id, LeaseBatchRequest(policy_version=0, count=4))
        out = pipeline.work_out(coord.state)
        await stop_all(coord, [greedy, honest])
        return greedy_grants, r.grants, out
    greedy_grants, honest_grants, out = run(body())
    # out_limit 12; a new identity may hold LeasePolicy.new_allowance (4) of them (slow start), and
    # newcomers together a quarter of the pool (3): the greedy one filled that budget, so the honest
    # newcomer waits for one of its short leases to expire, and 9 of 12 stay for identities with a record
    assert len(greedy_grants) == 3 < pipeline.LeasePolicy().new_allowance
    assert len(honest_grants) == 0 and out == 3


def test_junk_connection_flood_from_one_ip_is_capped_and_others_still_connect(tmp_path):
    import socket

    store = _serve_one_version(tmp_path)

    async def body():
        server = ShardServer(store, max_connections_per_ip=20)
        port = await server.start()
        junk = []
        for _ in range(60):
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.setblocking(False)
            try:
                await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", port))
                s.send(b"GET /shardcast/runs HTTP/1.1\r\nHost: x\r\n")  # slowloris: never finished
            except OSError:
                pass
            junk.append(s)
        await asyncio.sleep(0.3)
        held = dict(server.connections.open)
        async with aiohttp.ClientSession() as honest:
            async with honest.get(f"http://127.0.0.1:{port}/shardcast/runs") as r:
                ok = r.status, await r.json()
        for s in junk:
            s.close()
        refused = server.connections.refused
        await server.stop()
        return held, refused, ok
    held, refused, ok = run(body())
    assert held.get("127.0.0.2") == 20 and refused >= 40
    assert ok == (200, {"runs": ["r"]})
