"""`python -m benchmarks.fuzz --cases N`: every listening surface fed N fuzzed inputs, in process.

Surfaces (each with the property it must keep; anything else is a finding):
  envelope         protocol.envelope.open_envelope on mutated signed envelopes -> Opened or ProtocolError
  message_body     protocol.messages.decode_message on mutated bodies of every type -> Message or
                   MalformedMessage/MessageTooLarge
  coordinator_rpc  the coordinator's libp2p request handler (RunNetwork._on_request, the function the
                   stream handler calls) of a real CoordinatorService, with mutated bodies *re-signed*
                   by a joined member so they reach the handlers -> a signed reply, never an
                   InternalError (a handler exception that only the last-resort catch stopped)
  manifest         shardcast SignedManifest.from_json(...).verified(...) on mutated manifests ->
                   Manifest or ShardcastError
  shard            shardcast.codec.decode_shard on mutated zstd wire bytes (hash check skipped, so the
                   decoder itself sees them) -> CorruptShard only
  http_shardcast   a real ShardServer over HTTP: random paths, Range and other headers -> a 2xx/4xx/503,
                   never a 5xx error, and the server answers a valid request afterwards
  http_status      the coordinator's status page and /metrics over HTTP, random paths and queries
  wire_stream      over the real wire, from a separate process: libp2p streams to a real coordinator
  wire_gossip      with our length framing mutated, and fuzzed messages on its gossip topic
                   (benchmarks/fuzz_wire.py)

Inputs are seeds (valid objects of every kind), each followed by stacked random
mutations (bit flips, interesting bytes, inserts, deletes, truncation, splices, JSON-aware token
swaps), with one seed for the whole run. A hang is an input that takes longer than HANG_S.
The last line is one JSON object: per surface, inputs, inputs/s, findings, slowest input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("fuzz")

HANG_S = 1.0
"""An input slower than this is reported as a hang (the slowest honest input takes ~10 ms)."""
INTERESTING = [b"\x00", b"\xff", b"\x7f", b"\x80", b"-1", b"1e308", b"-0", b"null", b"[]", b"{}", b'""',
               b"9" * 30, b"\\u0000", b"\xc3\x28", b"NaN", b"true"]


def mutate(rng: random.Random, data: bytes, others: list[bytes]) -> bytes:
    """1-4 stacked random edits of `data` (bytes level and JSON-token level)."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(9)
        n = len(b)
        if op == 0 and n:
            i = rng.randrange(n)
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and n:
            i = rng.randrange(n)
            b[i:i + 1] = rng.choice(INTERESTING)
        elif op == 2:
            i = rng.randint(0, n)
            b[i:i] = rng.randbytes(rng.choice([1, 2, 8, 64]))
        elif op == 3 and n:
            i = rng.randrange(n)
            del b[i:i + rng.choice([1, 4, 32, n])]
        elif op == 4 and n:
            del b[rng.randrange(n):]
        elif op == 5 and others:
            o = rng.choice(others)
            i, j = rng.randint(0, n), rng.randint(0, len(o))
            b = b[:i] + o[j:]
        elif op == 6 and n:
            i = rng.randrange(n)
            b[i:i] = b[i:i + rng.choice([4, 64, 1024])] * rng.choice([2, 16])
        elif op == 7:  # JSON-aware: replace a number or a string token
            s = bytes(b)
            toks = [m.span() for m in re.finditer(rb'-?\d+(\.\d+)?|"[^"\\]*"', s)]
            if toks:
                i, j = rng.choice(toks)
                b = bytearray(s[:i] + rng.choice(INTERESTING + [b'"' + b"A" * rng.choice([0, 300, 70000]) + b'"',
                                                               str(rng.choice([2**64, -2**63 - 1, 10**400])).encode()])
                              + s[j:])
        elif op == 8:
            b = bytearray(rng.randbytes(rng.randint(0, 256)))
    return bytes(b)


class Surface:
    """One input surface: `seeds`, and `check(data)` raising `Finding` if its property breaks."""

    name = ""
    seeds: list[bytes]

    def check(self, data: bytes) -> None:
        raise NotImplementedError


class Finding(Exception):
    pass


# ---- protocol ------------------------------------------------------------------------------------

def sample_messages():
    from protocol.identity import NodeKey
    from protocol.messages import (Ban, BatchRequest, Heartbeat, Join, JoinAccepted, LeaseBatchRequest, LeaseGrant,
                                   LeaseGrants, Leave, Ok, PeerAddress, PolicyAnnounce, PublishPolicy,
                                   Refusal, RolloutGroup, RolloutSubmission, RunSpec, StoredWork, StoredWorkBatch,
                                   SubmissionReceipt, Verdict, VerdictBatch, VerifyRequest, WorkCancel)
    k, o = NodeKey.from_seed(b"k" * 32), NodeKey.from_seed(b"o" * 32)
    spec = RunSpec(run_id="fuzz", coordinator=k.peer_id)
    sub = RolloutSubmission(work_id=9, version_runs=[(3, 2), (4, 2)], token_ids=[5, 6, 7, 8],
                            logprobs=[-0.1, -2.0, 0.0, -0.3], reward=0.5, proof=bytes(range(64)), finish_reason="length")
    grant = LeaseGrant(work_id=9, holder=o.peer_id, policy_version=4, task_index=12, seed=2**63, deadline=1e9)
    return [spec, Join(spec_hash=spec.spec_hash(), role="inference", addrs=["/ip4/127.0.0.1/tcp/4001"]),
            JoinAccepted(spec=spec, policy_version=3, members=[PeerAddress(peer_id=o.peer_id, addrs=["/ip4/1.2.3.4/tcp/1"])]),
            Heartbeat(seq=7, role="validator", addrs=["/ip4/127.0.0.1/tcp/4002"]), Leave(reason="bye"),
            PolicyAnnounce(version=4, manifest_hash="ab" * 32), grant,
            sub, SubmissionReceipt(work_id=9, accepted=True), Refusal(reason="StaleRollout", detail="lag"),
            WorkCancel(work_ids=[1, 2], policy_version=5), Verdict(work_id=9, submitter=o.peer_id, valid=False, reason="x"),
            Ban(peer_id=o.peer_id, reason="forged", until=None), Ok(),
            RolloutGroup(work_id=0, rollouts=[sub.model_copy(update={"work_id": 0})] * 2),
            LeaseBatchRequest(policy_version=0, count=16), LeaseGrants(grants=[grant]), BatchRequest(step=1, groups=4),
            VerifyRequest(max_items=32),
            StoredWorkBatch(step=5, items=[StoredWork(work_id=9, task_index=1, seed=2, envelope=b"x" * 40)]),
            VerdictBatch(verdicts=[Verdict(work_id=9, submitter=o.peer_id, valid=True)]),
            PublishPolicy(version=5, manifest_hash="cd" * 32)]


class EnvelopeSurface(Surface):
    name = "envelope"

    def __init__(self):
        from protocol.envelope import ReplayGuard, seal
        from protocol.identity import NodeKey
        self.key, self.now = NodeKey.from_seed(b"k" * 32), 1.9e9
        self.guard = ReplayGuard()
        self.seeds = [seal(self.key, "fuzz", m, now=self.now) for m in sample_messages()]

    def check(self, data: bytes) -> None:
        from protocol.envelope import open_envelope
        from protocol.errors import ProtocolError
        try:
            open_envelope(data, "fuzz", self.guard, now=self.now)
        except ProtocolError:
            pass


class MessageBodySurface(Surface):
    name = "message_body"

    def __init__(self):
        from protocol.messages import encode_message
        self.seeds = [encode_message(m) for m in sample_messages()]

    def check(self, data: bytes) -> None:
        from protocol.errors import MalformedMessage, MessageTooLarge
        from protocol.messages import Message, decode_message
        try:
            if not isinstance(decode_message(data), Message):
                raise Finding("decoder returned a non-message")
        except (MalformedMessage, MessageTooLarge):
            pass


class CoordinatorRpcSurface(Surface):
    """The real request path of a coordinator, minus the socket: signed requests of a joined
    member (and mutated envelopes) into `RunNetwork._on_request`, on the service's own loop."""

    name = "coordinator_rpc"

    def __init__(self, directory: Path):
        self.directory = directory
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._start())

    async def _start(self) -> None:
        from protocol.coordinator import Coordinator
        from protocol.coordinator_service import CoordinatorService
        from protocol.envelope import seal
        from protocol.identity import NodeKey
        from protocol.messages import Join, RunSpec, encode_message
        from protocol.transport import PeerHost
        ck, self.member = NodeKey.from_seed(b"c" * 32), NodeKey.from_seed(b"m" * 32)
        spec = RunSpec(run_id="fuzz", coordinator=ck.peer_id, batch_groups=4, group_size=2)
        self.host = PeerHost(ck)
        await self.host.start()
        self.svc = CoordinatorService(ck, Coordinator(self.directory, spec, synchronous="OFF"), self.host)
        await self.svc.start()
        self.svc.state.advance_policy(0, "00" * 32, time.time())
        msgs = sample_messages()
        join = Join(spec_hash=self.svc.state.spec_hash, role="inference")
        await self.svc.net._on_request(self.member.peer_id, seal(self.member, "fuzz", join))
        self.seeds = [encode_message(m) for m in [join, *msgs]]
        self.envelopes = [seal(self.member, "fuzz", m) for m in msgs]

    def check(self, data: bytes) -> None:
        self.loop.run_until_complete(self._check(data))

    async def _check(self, data: bytes) -> None:
        from protocol.envelope import _DOMAIN, FORMAT, MAGIC, _HEAD, open_envelope  # noqa: F401
        import struct
        import os
        # Re-sign the mutated body as the member would: the signature passes, the body reaches
        # the decoder and, if it decodes, the handler.
        run = b"fuzz"
        head = _HEAD.pack(MAGIC, FORMAT, self.member.public_bytes, int(time.time() * 1000), os.urandom(16), len(run))
        unsigned = head + run + struct.pack(">I", len(data)) + data
        env = unsigned + self.member.sign(_DOMAIN + unsigned)
        before = self.svc.net.refused["InternalError"]
        reply = await self.svc.net._on_request(self.member.peer_id, env)
        if self.svc.net.refused["InternalError"] != before:
            raise Finding("handler raised an untyped exception (InternalError)")
        open_envelope(reply, "fuzz", None)  # the reply is always a valid signed message

    def close(self) -> None:
        async def stop():
            await self.svc.stop()
            self.svc.state.close()
            await self.host.stop()
        self.loop.run_until_complete(stop())
        self.loop.close()


# ---- shardcast -------------------------------------------------------------------------------------

def _published(directory: Path):
    import torch

    from protocol.identity import NodeKey
    from shardcast.publish import PublishOptions, publish
    from shardcast.store import Store
    key = NodeKey.from_seed(b"p" * 32)
    store = Store(directory)
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(64, 64, generator=g).bfloat16(), "b": torch.ones(100), "c": torch.tensor([3])}
    publish(store, key, "r", 0, state, options=PublishOptions(shard_size=4096))
    publish(store, key, "r", 1, {k: v + 1 for k, v in state.items()}, parent=0, options=PublishOptions(shard_size=4096))
    return key, store


class ManifestSurface(Surface):
    name = "manifest"

    def __init__(self, directory: Path):
        from shardcast.manifest import TrustedPublishers
        key, store = _published(directory)
        self.trusted = TrustedPublishers([key.peer_id])
        self.seeds = [store.manifest_path("r", v).read_bytes() for v in (0, 1)]

    def check(self, data: bytes) -> None:
        from protocol.errors import ProtocolError
        from shardcast.manifest import SignedManifest
        try:  # InvalidManifest, UnknownPublisher (ShardcastError) or InvalidSignature (protocol)
            SignedManifest.from_json(data).verified(self.trusted)
        except ProtocolError:
            pass


class ShardSurface(Surface):
    name = "shard"

    def __init__(self, directory: Path):
        import numpy as np
        key, store = _published(directory)
        self.entries = {}
        self.seeds = []
        for v in (0, 1):
            m = store.manifest("r", v).manifest
            for e in m.shards[:4]:
                wire = store.shard_path("r", v, e.index).read_bytes()
                self.entries[wire] = e
                self.seeds.append(wire)
        self.parent = np.zeros(4096, dtype=np.uint8)

    def check(self, data: bytes) -> None:
        import numpy as np

        from shardcast.codec import decode_shard
        from shardcast.errors import CorruptShard
        entry = self.entries.get(data) or next(iter(self.entries.values()))
        out = np.empty(entry.raw_size, dtype=np.uint8)
        try:
            decode_shard(entry, data, out, self.parent[:entry.raw_size] if len(data) % 2 else None)
        except CorruptShard:
            pass


# ---- HTTP ------------------------------------------------------------------------------------------

SEGMENTS = ["shardcast", "r", "0", "1", "manifest", "have", "shard", "versions", "runs", "..", ".", "%2e%2e", "",
            "99999999999999", "-1", "0x10", "é", "%00", "a" * 300, "status.json", "metrics", "?x=1", "%ff"]
RANGES = ["bytes=0-10", "bytes=-5", "bytes=5-", "bytes=10-5", "bytes=0-0,5-9", "bytes=999999999-", "bytes=a-b",
          "items=0-1", "bytes=-0", "bytes=--1", "bytes=0-18446744073709551616", ""]


class HttpSurface(Surface):
    """Random requests against a real aiohttp app on 127.0.0.1 (raw HTTP/1.1 over one keep-alive
    connection per worker, so the request line and headers are fuzzed too)."""

    def __init__(self, name: str, app_factory: Callable, valid_path: str):
        self.name, self.app_factory, self.valid_path = name, app_factory, valid_path
        self.seeds = [f"GET {valid_path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()]

    def request_bytes(self, rng: random.Random) -> tuple[bytes, bool]:
        """Raw request bytes, and whether they are a complete request (else the server may wait)."""
        path = "/" + "/".join(rng.choice(SEGMENTS) for _ in range(rng.randint(0, 6)))
        if rng.random() < 0.5:
            path = "/shardcast/r/" + rng.choice(["0", "1", "7"]) + "/" + rng.choice(["manifest", "have", "shard/0",
                                                                                      "shard/1", "shard/99", "shard/x"])
        method = rng.choice(["GET"] * 8 + ["HEAD", "POST", "DELETE", "OPTIONS", "G\x00T"])
        headers = ["Host: x", "Connection: close"]
        if rng.random() < 0.6:
            headers.append("Range: " + rng.choice(RANGES))
        if rng.random() < 0.2:
            headers.append(rng.choice(["If-Range: x", "Accept-Encoding: gzip, br", "Content-Length: 5", "Expect: 100-continue",
                                       "Transfer-Encoding: chunked", "X: " + "y" * 9000]))
        req = f"{method} {path} HTTP/1.1\r\n" + "\r\n".join(headers) + "\r\n\r\n"
        raw = req.encode("utf-8", "surrogateescape")
        if rng.random() < 0.15:
            return mutate(rng, raw, self.seeds), False
        return raw, "Content-Length: 5" not in req and "chunked" not in req


async def run_http(surface: HttpSurface, cases: int, seed: int, workers: int = 32) -> dict:
    """Fire `cases` requests; a finding is a 5xx other than 503, a dead server, or a hang."""
    from aiohttp import web
    app, cleanup = await surface.app_factory()
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    findings: list[dict] = []
    slowest = [0.0]
    done, answered = [0], [0]
    statuses: dict[int, int] = {}

    async def worker(w: int) -> None:
        # One connection per input (`Connection: close`). A complete request must be answered
        # within 5 s (else: hang); a mutated one may be incomplete, and the server may wait for
        # the rest, so after 0.3 s without an answer we hang up (not a finding).
        rng = random.Random(seed * 1000 + w)
        while done[0] < cases:
            done[0] += 1
            raw, complete = surface.request_bytes(rng)
            t = time.perf_counter()
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError as exc:
                findings.append({"kind": f"connect failed: {exc}", "input": ""})
                continue
            answer = b""
            try:
                writer.write(raw)
                answer = await asyncio.wait_for(reader.read(), 5 if complete else 0.3)
            except asyncio.TimeoutError:
                if complete:
                    findings.append({"kind": "hang", "input": raw[:300].decode("latin-1")})
            except (ConnectionError, asyncio.IncompleteReadError):
                pass  # a reset is an answer too: the server refused the bytes
            finally:
                writer.close()
            answered[0] += bool(answer)
            slowest[0] = max(slowest[0], time.perf_counter() - t)
            for line in re.findall(rb"HTTP/1\.[01] (\d{3})", answer[:100_000]):
                status = int(line)
                statuses[status] = statuses.get(status, 0) + 1
                if status >= 500 and status != 503:
                    findings.append({"kind": f"HTTP {status}", "input": raw[:300].decode("latin-1")})

    t0 = time.perf_counter()
    await asyncio.gather(*[worker(w) for w in range(workers)])
    wall = time.perf_counter() - t0
    # The server still answers a valid request.
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(surface.seeds[0])
    alive = (await asyncio.wait_for(r.readline(), 5)).startswith(b"HTTP/1.1 200")
    w.close()
    if not alive:
        findings.append({"kind": "server stopped answering", "input": ""})
    await runner.cleanup()
    await cleanup()
    return {"inputs": cases, "inputs_per_s": round(cases / wall, 1), "findings": len(findings),
            "finding_examples": findings[:5], "slowest_s": round(slowest[0], 4), "wall_s": round(wall, 1),
            "answered": answered[0], "statuses": dict(sorted(statuses.items()))}


def shardcast_app(directory: Path):
    async def factory():
        from protocol.limits import LimitConfig
        from shardcast.server import ShardServer
        _, store = _published(directory)
        # Limits lifted: the fuzzer is one client, and it is here to reach the handlers.
        server = ShardServer(store, limits=LimitConfig(rate_per_s=1e9, burst=1e9, max_inflight=10**6,
                                                       max_total_inflight=10**6))

        async def cleanup():
            return None
        return server.app, cleanup
    return factory


def status_app(directory: Path):
    async def factory():
        from aiohttp import web

        from node.roles.status import serve_status
        rpc = CoordinatorRpcSurface.__new__(CoordinatorRpcSurface)
        rpc.directory = directory
        await rpc._start()
        runner, port = await serve_status(rpc.svc, 0)
        # serve_status starts its own site; re-serve its app on ours and stop its runner.
        app = runner.app
        await runner.cleanup()
        fresh = web.Application()
        fresh.router.add_routes([web.route(r.method, r.resource.canonical, r.handler) for r in app.router.routes()
                                 if r.method != "HEAD"])

        async def cleanup():
            await rpc.svc.stop()
            rpc.svc.state.close()
            await rpc.host.stop()
        return fresh, cleanup
    return factory


# ---- driver -------------------------------------------------------------------------------------------

def run_surface(surface: Surface, cases: int, seed: int, progress: bool = True) -> dict:
    rng = random.Random(seed)
    findings: list[dict] = []
    slowest = 0.0
    t0 = time.perf_counter()
    for i in range(cases):
        base = surface.seeds[i % len(surface.seeds)]
        data = base if i < len(surface.seeds) else mutate(rng, base, surface.seeds)
        t = time.perf_counter()
        try:
            surface.check(data)
        except Finding as exc:
            findings.append({"kind": str(exc), "input": data[:300].hex()})
        except Exception as exc:  # the property: nothing but the surface's typed errors escapes
            findings.append({"kind": f"{type(exc).__name__}: {str(exc)[:200]}", "input": data[:300].hex()})
        dt = time.perf_counter() - t
        slowest = max(slowest, dt)
        if dt > HANG_S:
            findings.append({"kind": f"hang ({dt:.2f}s)", "input": data[:300].hex()})
        if progress and (i + 1) % 20000 == 0:
            log.info("%s: %d/%d inputs, %d findings", surface.name, i + 1, cases, len(findings))
    wall = time.perf_counter() - t0
    return {"inputs": cases, "inputs_per_s": round(cases / wall, 1), "findings": len(findings),
            "finding_examples": findings[:5], "slowest_s": round(slowest, 4), "wall_s": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=100_000, help="inputs per surface")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", help="surface names to run")
    ap.add_argument("--out", type=Path, help="also write the JSON result here")
    ap.add_argument("--wire-workers", type=int, default=None, help="wire surfaces: concurrent streams (or publishes)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("protocol.network", "protocol.coordinator_service", "protocol.coordinator", "libp2p"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    logging.getLogger("aiohttp").setLevel(logging.CRITICAL)  # it logs every 400 it answers at ERROR
    want = set(args.only or ["envelope", "message_body", "coordinator_rpc", "manifest", "shard", "http_shardcast",
                             "http_status", "wire_stream", "wire_gossip"])
    result: dict = {"benchmark": "fuzz", "seed": args.seed, "cases_per_surface": args.cases, "surfaces": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        makers = {"envelope": EnvelopeSurface, "message_body": MessageBodySurface,
                  "coordinator_rpc": lambda: CoordinatorRpcSurface(tmp / "coord"),
                  "manifest": lambda: ManifestSurface(tmp / "m"), "shard": lambda: ShardSurface(tmp / "s")}
        for name, make in makers.items():
            if name in want:
                surface = make()
                log.info("fuzzing %s (%d seeds)", name, len(surface.seeds))
                result["surfaces"][name] = run_surface(surface, args.cases, args.seed)
                if hasattr(surface, "close"):
                    surface.close()
                log.info("%s: %s", name, result["surfaces"][name])
        http = {"http_shardcast": HttpSurface("http_shardcast", shardcast_app(tmp / "h"), "/shardcast/runs"),
                "http_status": HttpSurface("http_status", status_app(tmp / "st"), "/status.json")}
        for name, surface in http.items():
            if name in want:
                log.info("fuzzing %s", name)
                result["surfaces"][name] = asyncio.run(run_http(surface, args.cases, args.seed))
                log.info("%s: %s", name, result["surfaces"][name])
        wire = [n for n in ("wire_stream", "wire_gossip") if n in want]
        if wire:
            from benchmarks.fuzz_wire import run_wire
            log.info("fuzzing %s from a separate process", wire)
            from benchmarks.fuzz_wire import WORKERS
            out = asyncio.run(run_wire(wire, args.cases, args.seed, tmp / "wire", workers=args.wire_workers or WORKERS))
            for n in wire:
                result["surfaces"][n] = out.get(n, {"inputs": 0, "inputs_per_s": 0, "findings": 1,
                                                    "finding_examples": [f"client exit {out.get('client_exit')}"]})
            result["wire"] = {k: out.get(k) for k in ("probes_failed", "client_exit", "coordinator")}
            if out.get("probes_failed"):
                result["surfaces"][wire[0]]["findings"] += len(out["probes_failed"])
    s = result["surfaces"]
    result["total_inputs"] = sum(v["inputs"] for v in s.values())
    result["total_findings"] = sum(v["findings"] for v in s.values())
    # Peer figure: the cheapest surface's rate, so each surface's cost reads as a ratio to it.
    fastest = max((v["inputs_per_s"] for v in s.values()), default=0)
    for v in s.values():
        v["cost_vs_fastest_surface"] = round(fastest / v["inputs_per_s"], 2) if v["inputs_per_s"] else None
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
