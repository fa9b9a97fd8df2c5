"""Discrete-event model of a shardcast swarm: links, servers, churn; the decisions are shardcast's.

Every choice a real node makes is made here by the same code: each fetching host (relay or
inference node) holds a real `shardcast.sources.ShardSchedule` over a real `SourcePool` whose clock
is the simulated clock; it picks (source, shard) with `next()`, and reports `succeeded`/`failed`
with the same `Outcome`s the fetcher maps its exceptions to. Relays decide what to mirror with
`shardcast.relay.versions_to_mirror`. Servers apply the real admission rule with the real numbers
(`shardcast.server`: `max_concurrent` bodies, half of them per client, `queue_timeout` then 503).
A source's `have`/`fetching` sets are the very sets its owner updates, i.e. `/have` with no
refresh delay (real fetchers re-read it every `HAVE_REFRESH_S` = 0.25 s while a worker idles,
every len(sources) / `HAVE_REQUESTS_PER_S` s (8 peers: 1 s) while all are busy).

What is modelled, not run: bytes move as flows; a flow's rate is min(sender's uplink / its
flows, receiver's downlink / its flows), recomputed every tick `dt` for all flows at once
(fair per-host sharing, not full max-min; a flow ends within one tick of its exact end). A request costs half the pair's RTT to reach the
server, the body's last byte half an RTT to arrive; pair RTT = (a.rtt + b.rtt) / 2. Decoding and
hashing a shard is a flow through the host's CPU (`cpu` bytes/s of raw output, shared by its
concurrent decodes). A node that leaves cuts its flows: its downloaders see `TRUNCATED`, later
requests to it `UNAVAILABLE` (connection refused), and its `/have` empties.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

import numpy as np

from shardcast.seeding import SeedOffer
from shardcast.server import DEFAULT_MAX_CONCURRENT, DEFAULT_QUEUE_TIMEOUT
from shardcast.sources import STARVE_S, Outcome, ShardSchedule, SourcePool

FALLBACK_WAKE_S = STARVE_S / 2
"""An idle fetcher with nothing to pick is woken by a peer's new shard, a freed slot or a
cooldown's end; this wake (the real fetcher polls every 50 ms) lets the starvation rule and the
no-holder timeout fire."""


@dataclass(eq=False)
class Host:
    name: str
    kind: str
    """origin | relay | node"""
    up: float
    """Uplink, bytes/s."""
    down: float
    """Downlink, bytes/s."""
    rtt: float
    """Round trip to the core of the internet, s."""
    cpu: "Host | None" = None
    """Where its decodes run (its own CPU, or one shared by every process on a loopback host)."""
    parallel: int = 8
    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    have: set[int] = field(default_factory=set)
    fetching: set[int] = field(default_factory=set)
    up_flows: set = field(default_factory=set)
    down_flows: set = field(default_factory=set)
    slots: int = 0
    per_client: dict = field(default_factory=dict)
    queue: dict = field(default_factory=dict)
    """Requests waiting for a slot, oldest first: id -> (client, source, shard, time)."""
    alive: bool = True
    schedule: ShardSchedule | None = None
    idle: int = 0
    watchers: list = field(default_factory=list)
    """Hosts whose pools list this one: woken when it gains a shard."""
    wake_at: float = float("inf")
    t_done: float | None = None
    bytes_sent: float = 0.0
    failed: str | None = None
    ix: int = -1
    """Row in the flow table's capacity arrays."""
    seed: SeedOffer | None = None
    """A super-seeding origin's offer policy (shardcast.seeding); `have` is then what it offers."""


@dataclass(eq=False)
class Flow:
    src: Host
    dst: Host
    size: float
    left: float
    t: float
    on_end: object
    req: tuple | None = None
    """(client, its Source for the server, shard, request time, last resort) for a shard body."""
    slot: int = -1


class FlowTable:
    """Active flows as arrays, advanced together: rate = min(src up / its flows, dst down / its
    flows), recomputed every tick (vectorised; a flow ends within one tick of its exact end)."""

    def __init__(self, up: list[float], down: list[float]):
        self.up, self.down = np.asarray(up, dtype=float), np.asarray(down, dtype=float)
        cap = 1024
        self.src = np.zeros(cap, dtype=np.int64)
        self.dst = np.zeros(cap, dtype=np.int64)
        self.left = np.zeros(cap)
        self.on = np.zeros(cap, dtype=bool)
        self.objs: list[Flow | None] = [None] * cap
        self.free = list(range(cap - 1, -1, -1))
        self.active = 0

    def add(self, f: Flow) -> None:
        if not self.free:
            n = len(self.on)
            for name in ("src", "dst", "left", "on"):
                arr = getattr(self, name)
                setattr(self, name, np.concatenate([arr, np.zeros_like(arr)]))
            self.objs += [None] * n
            self.free = list(range(2 * n - 1, n - 1, -1))
        k = self.free.pop()
        f.slot = k
        self.src[k], self.dst[k], self.left[k], self.on[k], self.objs[k] = f.src.ix, f.dst.ix, f.size, True, f
        self.active += 1

    def remove(self, f: Flow) -> float:
        k = f.slot
        moved = f.size - max(0.0, float(self.left[k]))
        self.on[k], self.objs[k] = False, None
        self.free.append(k)
        self.active -= 1
        return moved

    def step(self, dt: float) -> list[Flow]:
        idx = np.flatnonzero(self.on)
        src, dst = self.src[idx], self.dst[idx]
        n = len(self.up)
        n_up = np.bincount(src, minlength=n)
        n_down = np.bincount(dst, minlength=n)
        with np.errstate(invalid="ignore"):
            rate = np.minimum(self.up[src] / n_up[src], self.down[dst] / n_down[dst])
        left = self.left[idx] - rate * dt
        self.left[idx] = left
        return [self.objs[k] for k in idx[left <= 0]]


SINK = Host("sink", "sink", float("inf"), float("inf"), 0.0)


class Swarm:
    """One version fetched by every host at once; `run()` returns when all are done or gone."""

    def __init__(self, hosts: list[Host], sources_of: dict[str, list[str]], shard_wire: list[float], shard_raw: list[float],
                 start_at: dict[str, float], leave_at: dict[str, float], seed: int = 0, dt: float = 0.01):
        self.hosts = {h.name: h for h in hosts}
        resources = [SINK] + hosts + [h.cpu for h in hosts if h.cpu is not None]
        resources = list({id(r): r for r in resources}.values())
        for k, r in enumerate(resources):
            r.ix = k
        self.flows = FlowTable([r.up for r in resources], [r.down for r in resources])
        self.dt = dt
        """Flow tick, s: a fraction of the shortest shard transfer (the caller picks it)."""
        self.next_tick = 0.0
        self.wire, self.raw = shard_wire, shard_raw
        self.now = 0.0
        self.events: list = []
        self.seq = itertools.count()
        self.rng = random.Random(seed)
        n = len(shard_wire)
        for h in hosts:
            if h.kind == "origin":
                h.have = set(range(n))  # with a seed policy: the shards it still offers
        for name, srcs in sources_of.items():
            host = self.hosts[name]
            pool = SourcePool.of(srcs, clock=lambda: self.now, rng=random.Random(self.rng.random()))
            pool.new_version()
            for s in pool.sources:
                peer = self.hosts[s.url]
                s.have, s.fetching, s.seed = peer.have, peer.fetching, peer.seed is not None
                peer.watchers.append(host)
            host.schedule = ShardSchedule(pool, set(range(n)), host.parallel, inflight=host.fetching)
            host.idle = host.parallel
            self.at(start_at.get(name, 0.0), self._fill, host)
        for name, t in leave_at.items():
            self.at(t, self._leave, self.hosts[name])

    # -- event loop ------------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn, args))

    def run(self, until: float = 1e7) -> None:
        """Events in time order; between them, active flows advance in ticks of `self.dt`."""
        while self.events or self.flows.active:
            t_event = self.events[0][0] if self.events else math.inf
            if self.flows.active and self.next_tick <= t_event:
                self.now = self.next_tick
                for f in self.flows.step(self.dt):
                    self._flow_end(f)
                self.next_tick = self.now + self.dt
                continue
            if t_event > until:
                break
            t, _, fn, args = heapq.heappop(self.events)
            self.now = t
            if not self.flows.active:
                self.next_tick = t + self.dt
            fn(*args)

    def pair_rtt(self, a: Host, b: Host) -> float:
        return (a.rtt + b.rtt) / 2

    # -- flows -------------------------------------------------------------------------------
    def _start_flow(self, src: Host, dst: Host, size: float, on_end, req: tuple | None = None) -> Flow:
        f = Flow(src, dst, size, size, self.now, on_end, req)
        self.flows.add(f)
        src.up_flows.add(f)
        dst.down_flows.add(f)
        return f

    def _flow_end(self, f: Flow) -> None:
        self._stop_flow(f)
        f.on_end()

    def _stop_flow(self, f: Flow) -> float:
        """Remove `f`; returns the bytes it moved."""
        moved = self.flows.remove(f)
        f.src.up_flows.discard(f)
        f.dst.down_flows.discard(f)
        f.src.bytes_sent += moved
        return moved

    # -- a fetching host -------------------------------------------------------------------
    def _fill(self, host: Host) -> None:
        plan = host.schedule
        if not host.alive or plan is None or host.t_done is not None:
            return
        while host.idle > 0 and not plan.done:
            pick = plan.next()
            if pick is None:
                break
            src, i, last_resort = pick
            host.idle -= 1
            server = self.hosts[src.url]
            self.at(self.now + self.pair_rtt(host, server) / 2, self._arrive, server, host, src, i, self.now, last_resort)
        if plan.error is not None and host.failed is None:
            host.failed = plan.error
        elif not plan.done and host.idle > 0:
            cool = [s.cooldown_until for s in plan.pool.alive() if s.cooldown_until > self.now]
            wake = min(cool) if cool else self.now + FALLBACK_WAKE_S
            if wake < host.wake_at or host.wake_at <= self.now:
                host.wake_at = wake
                self.at(wake, self._fill, host)

    def _answer(self, client: Host, server: Host, src, i: int, outcome: Outcome, reason: str) -> None:
        self.at(self.now + self.pair_rtt(client, server) / 2, self._failed, client, src, i, outcome, reason)

    def _failed(self, client: Host, src, i: int, outcome: Outcome, reason: str) -> None:
        if not client.alive:
            return
        client.schedule.failed(src, i, outcome, reason)
        client.idle += 1
        self._fill(client)

    # -- a serving host --------------------------------------------------------------------
    def _arrive(self, server: Host, client: Host, src, i: int, t_req: float, last_resort: bool) -> None:
        if not client.alive:
            return
        if not server.alive:
            return self._answer(client, server, src, i, Outcome.UNAVAILABLE, "connection refused")
        if server.kind != "origin" and i not in server.have:
            return self._answer(client, server, src, i, Outcome.NOT_FOUND, "404")
        if server.per_client.get(client.name, 0) >= max(1, server.max_concurrent // 2):
            return self._answer(client, server, src, i, Outcome.BUSY, "503 (client's share)")
        server.per_client[client.name] = server.per_client.get(client.name, 0) + 1
        req = (client, src, i, t_req, last_resort)
        if server.slots < server.max_concurrent:
            self._serve(server, req)
        else:
            rid = next(self.seq)
            server.queue[rid] = req
            self.at(self.now + DEFAULT_QUEUE_TIMEOUT, self._queue_timeout, server, rid)

    def _queue_timeout(self, server: Host, rid: int) -> None:
        req = server.queue.pop(rid, None)
        if req is not None:
            self._release(server, req[0])
            self._answer(req[0], server, req[1], req[2], Outcome.BUSY, "503 (queue timeout)")

    def _release(self, server: Host, client: Host) -> None:
        left = server.per_client.get(client.name, 1) - 1
        if left > 0:
            server.per_client[client.name] = left
        else:
            server.per_client.pop(client.name, None)

    def _serve(self, server: Host, req) -> None:
        client, src, i, t_req, last_resort = req
        if server.seed is not None:
            if not server.seed.admit("run", 1, i, last_resort):
                self._release(server, client)
                self._answer(client, server, src, i, Outcome.NOT_OFFERED, "425")
                return
            if server.seed.offered("run", 1, [i]) == []:
                server.have.discard(i)
        server.slots += 1

        def done() -> None:
            server.slots -= 1
            self._release(server, client)
            self._next_in_queue(server)
            self.at(self.now + self.pair_rtt(client, server) / 2, self._received, client, src, i, t_req)

        self._start_flow(server, client, self.wire[i], done, req)

    def _received(self, client: Host, src, i: int, t_req: float) -> None:
        if not client.alive:
            return
        seconds = self.now - t_req
        self._start_flow(client.cpu or SINK, SINK, self.raw[i], lambda: self._verified(client, src, i, seconds))

    def _verified(self, client: Host, src, i: int, seconds: float) -> None:
        if not client.alive:
            return
        client.schedule.succeeded(src, i, self.wire[i], seconds)
        client.have.add(i)
        client.idle += 1
        if client.schedule.done and client.schedule.error is None:
            client.t_done = self.now
        for w in client.watchers:
            if w.idle > 0 and w.schedule is not None and i in w.schedule.pending:
                self._fill(w)
        self._fill(client)

    # -- churn -------------------------------------------------------------------------------
    def _leave(self, host: Host) -> None:
        if not host.alive or host.t_done is not None:
            return
        host.alive = False
        host.have.clear()  # its /have now fails: the refresher reads that as holding nothing
        host.fetching.clear()
        for f in list(host.up_flows):
            self._stop_flow(f)
            if f.req is not None:  # the downloader sees the connection cut mid-shard
                client, src, i = f.req[:3]
                self._answer(client, host, src, i, Outcome.TRUNCATED, "connection cut mid-shard")
        for f in list(host.down_flows):
            self._stop_flow(f)
            server = f.src
            server.slots -= 1
            self._release(server, host)
            self._next_in_queue(server)
        for server in self.hosts.values():
            for rid in [rid for rid, r in server.queue.items() if r[0] is host]:
                del server.queue[rid]
                self._release(server, host)

    def _next_in_queue(self, server: Host) -> None:
        while server.queue and server.alive and server.slots < server.max_concurrent:
            rid = next(iter(server.queue))
            self._serve(server, server.queue.pop(rid))
