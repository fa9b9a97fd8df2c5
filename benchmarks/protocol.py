"""Protocol benchmark: submissions/s a coordinator accepts (signed, verified, persisted) and gossip
propagation latency across 16 peers, all on 127.0.0.1.

    python -m benchmarks.protocol [--submissions 600] [--concurrency 8] [--peers 16] [--messages 60]

Peers measured in the same run: (1) a bare libp2p request/response echo of the same bytes over
the same PeerHost (what the transport alone allows), (2) the coordinator state alone without the
network (what SQLite + fsync allow), (3) a direct stream round trip between two of the gossip peers.
Prints progress, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

from protocol.client import ONCE, CoordinatorClient
from protocol.coordinator import Coordinator
from protocol.coordinator_service import CoordinatorService
from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.member import RunMember
from protocol.messages import Join, PolicyAnnounce, RolloutSubmission, RunSpec
from protocol.network import RunNetwork
from protocol.transport import PeerHost

TOKENS = 256


def rollout(work_id: int) -> RolloutSubmission:
    """A 256-token rollout with a TOPLOC-sized proof (258 bytes per 32 tokens)."""
    return RolloutSubmission(work_id=work_id, version_runs=[(0, TOKENS)], token_ids=[work_id % 50_000] * TOKENS,
                             logprobs=[-0.25] * TOKENS, reward=1.0, proof=b"\x07" * (258 * TOKENS // 32),
                             finish_reason="eos")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def coordinator_and_members(ck: NodeKey, state: Coordinator, n: int, request_timeout: float = 30,
                                  validators: tuple[NodeKey, ...] = ()
                                  ) -> tuple[CoordinatorService, list[CoordinatorClient]]:
    """The coordinator role's service on 127.0.0.1 with policy version 0 announced, and `n` inference members
    joined to it, each behind a client that does not retry, then one "validator" member per key of `validators`
    (the spec must name them). No Sybil lease policy: every member is a newcomer here, and what is timed is the
    service, not the slow start."""
    host = PeerHost(ck)
    await host.start()
    service = CoordinatorService(ck, state, host)
    service.lease_policy = None  # the per-peer cap only: newcomers' slow start (4 leases) would hold `take` forever
    await service.start()
    await service.announce_policy(0, "00" * 32)
    members = []
    for k, role in [*((NodeKey.generate(), "inference") for _ in range(n)), *((v, "validator") for v in validators)]:
        h = PeerHost(k)
        await h.start()
        m = RunMember(k, h, state.spec, role, request_timeout=request_timeout)
        await m.join(host.addrs[0])
        members.append(CoordinatorClient(m, retry=ONCE))
    return service, members


async def stop_coordinator_and_members(service: CoordinatorService, members: list[CoordinatorClient]) -> None:
    for c in members:
        await c.member.crash()
        await c.member.host.stop()
    await service.stop()
    service.state.close()
    await service.host.stop()


async def bench_submissions(n: int, concurrency: int, workdir: Path) -> dict:
    ck = NodeKey.generate()
    # batch_groups: the lease throttle (protocol/pipeline.py out_limit) lets all n units out at once
    spec = RunSpec(run_id="bench", coordinator=ck.peer_id, max_off_policy_steps=4, heartbeat_interval_s=5.0,
                   lease_ttl_s=600, batch_groups=min(65_536, max(1, n)))
    service, members = await coordinator_and_members(ck, Coordinator(workdir / "net", spec, defer_fsync=True),
                                                     concurrency)  # as `coordinator launch` stores
    per = n // concurrency

    async def take(c: CoordinatorClient) -> list[int]:
        held: list[int] = []
        while len(held) < per:
            held += [g.work_id for g in await c.lease(min(1024, per - len(held)))]
        return held
    grants = [await take(c) for c in members]
    print(f"[submit] {concurrency} members hold {per} leases each; submitting {per * concurrency} rollouts", flush=True)

    async def drive(c: CoordinatorClient, work_ids: list[int]) -> int:
        ok = 0
        for w in work_ids:
            ok += (await c.submit(rollout(w))).accepted
        return ok

    t0 = time.perf_counter()
    accepted = sum(await asyncio.gather(*(drive(m, g) for m, g in zip(members, grants))))
    net_rate = accepted / (time.perf_counter() - t0)
    assert len(service.state.accepted_rollouts()) == accepted == per * concurrency
    print(f"[submit] coordinator accepted {accepted} at {net_rate:.0f}/s (signed, verified, fsynced, indexed)", flush=True)

    # Peer 1: the bare transport, same payload size, same number of concurrent streams.
    payload = seal(members[0].member.key, "bench", rollout(0))

    async def echo(_peer: str, data: bytes) -> bytes:
        return data[:64]
    service.host.serve("/bench/echo/1", echo)

    async def drive_echo(c: CoordinatorClient, count: int) -> None:
        for _ in range(count):
            await c.member.host.request(ck.peer_id, "/bench/echo/1", payload, timeout=30)
    t0 = time.perf_counter()
    await asyncio.gather(*(drive_echo(m, per) for m in members))
    echo_rate = per * concurrency / (time.perf_counter() - t0)
    print(f"[submit] bare libp2p request/response of the same {len(payload)} bytes: {echo_rate:.0f}/s", flush=True)

    await stop_coordinator_and_members(service, members)

    # Peer 2: the coordinator state alone (no network, no signing): one fsync per submission,
    # and groups the size of the client concurrency (what the service's committer forms under load).
    state_rates = {}
    for group in (1, concurrency):
        c = Coordinator(workdir / f"state-{group}", spec)
        w = NodeKey.generate()
        c.join(w.peer_id, Join(spec_hash=c.spec_hash, role="inference"), time.time())
        c.advance_policy(0, "00" * 32, time.time())
        work = [(c.grant_lease(w.peer_id, time.time()).work_id) for _ in range(n)]
        items = [(w.peer_id, rollout(i), seal(w, "bench", rollout(i))) for i in work]
        t0 = time.perf_counter()
        for k in range(0, n, group):
            assert all(r.accepted for r in c.submit_many(items[k:k + group], time.time()))
        state_rates[group] = n / (time.perf_counter() - t0)
        c.close()
        print(f"[submit] coordinator state alone, groups of {group}: {state_rates[group]:.0f}/s", flush=True)
    return {"submissions": accepted, "concurrency": concurrency, "tokens_per_rollout": TOKENS,
            "envelope_bytes": len(payload), "accepted_per_s": round(net_rate, 1),
            "bare_request_per_s": round(echo_rate, 1), "state_only_per_s_group_1": round(state_rates[1], 1),
            f"state_only_per_s_group_{concurrency}": round(state_rates[concurrency], 1),
            "ratio_accepted_vs_bare_request": round(net_rate / echo_rate, 3)}


async def bench_gossip(peers: int, messages: int) -> dict:
    rng = random.Random(0)
    keys = [NodeKey.generate() for _ in range(peers)]
    hosts = [PeerHost(k) for k in keys]
    for h in hosts:
        await h.start()
    # Bootstrap through peer 0, then each peer dials 3 random others (as discovery would).
    for i, h in enumerate(hosts[1:], 1):
        await h.connect(hosts[0].addrs[0])
        for j in rng.sample(range(1, peers), 3):
            if j != i:
                await h.connect(hosts[j].addrs[0])
    nets = [RunNetwork(h, k, "bench-gossip") for h, k in zip(hosts, keys)]
    sent: dict[int, float] = {}
    lat: list[float] = []
    seen: dict[int, int] = {}
    for net in nets:
        async def on(o, _net=net):
            v = o.message.version
            lat.append(time.perf_counter() - sent[v])
            seen[v] = seen.get(v, 0) + 1
        net.on_gossip(on)
        await net.start_gossip()
    print(f"[gossip] {peers} peers connected; letting the mesh form", flush=True)
    await asyncio.sleep(3.0)
    for v in range(messages):
        src = nets[rng.randrange(peers)]
        sent[v] = time.perf_counter()
        await src.gossip(PolicyAnnounce(version=v, manifest_hash="ab" * 32))
        await asyncio.sleep(0.05)
    deadline = time.monotonic() + 15
    while sum(seen.values()) < messages * (peers - 1) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    delivered = sum(seen.values())
    print(f"[gossip] delivered {delivered}/{messages * (peers - 1)} (message, receiver) pairs", flush=True)
    # Peer: direct stream round trip between two of the same peers.
    async def echo(_p: str, d: bytes) -> bytes:
        return d
    hosts[1].serve("/bench/echo/1", echo)
    await hosts[2].connect(hosts[1].addrs[0])
    rtts = []
    for _ in range(100):
        t0 = time.perf_counter()
        await hosts[2].request(keys[1].peer_id, "/bench/echo/1", b"x" * 200, timeout=10)
        rtts.append(time.perf_counter() - t0)
    for net, h in zip(nets, hosts):
        await net.close()
        await h.stop()
    p50, p99 = pct(lat, 0.5), pct(lat, 0.99)
    print(f"[gossip] propagation p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms; direct RTT p50 "
          f"{statistics.median(rtts) * 1e3:.1f} ms", flush=True)
    return {"gossip_peers": peers, "gossip_messages": messages, "gossip_delivery_ratio": round(delivered / (messages * (peers - 1)), 4),
            "gossip_p50_ms": round(p50 * 1e3, 2), "gossip_p99_ms": round(p99 * 1e3, 2),
            "direct_rtt_p50_ms": round(statistics.median(rtts) * 1e3, 2),
            "ratio_gossip_p50_vs_direct_rtt": round(p50 / statistics.median(rtts), 2)}


async def main_async(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sub = await bench_submissions(args.submissions, args.concurrency, Path(tmp))
    gossip = await bench_gossip(args.peers, args.messages)
    return {"benchmark": "protocol", "machine": args.machine, "python": platform.python_version(), **sub, **gossip}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--submissions", type=int, default=600)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--peers", type=int, default=16)
    p.add_argument("--messages", type=int, default=60)
    p.add_argument("--machine", default="cpu-2core")
    p.add_argument("--out", type=Path, help="also write the JSON here (e.g. benchmarks/results/protocol-cpu-2core.json)")
    args = p.parse_args()
    result = asyncio.run(main_async(args))
    line = json.dumps(result)
    if args.out:
        args.out.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
