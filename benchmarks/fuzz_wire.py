"""Fuzzing over the real wire: a real coordinator in this process, the fuzzer in another.

    python -m benchmarks.fuzz --only wire_stream wire_gossip [--cases 100000]   (or python -m benchmarks.fuzz_wire)

Unlike the in-process surfaces of `benchmarks.fuzz`, every input here crosses libp2p (TCP, noise,
yamux, multistream-select) from a separate OS process (`python -m benchmarks.fuzz_wire client`):

  wire_stream   raw bytes on the coordinator's request protocol: our 4-byte length framing mutated
                (lengths too short, too long, over 16 MiB, zero; frames cut inside the prefix or
                the body; trailing bytes; two frames in one stream; random bytes) around envelopes
                whose bodies are mutated and re-signed by a joined member (so they reach the
                handlers) or mutated as they are. Property: each stream ends within HANG_S with
                either no reply (reset or EOF) or one frame holding an envelope the coordinator
                signed; the coordinator never counts an InternalError.
  wire_gossip   the same bodies published on the run's gossip topic (re-signed or raw). Property:
                the coordinator's gossip validator and handlers log no untyped error.

For both, a second joined member (a different key) makes an honest request every PROBE_EVERY
inputs and at the end; each must be answered. The coordinator runs with its per-peer limits
lifted (one fuzzing client is here to reach the handlers, not to measure the limiter).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("fuzz.wire")

HANG_S = 35.0
"""A stream not ended this long after the fuzzer half-closed it is a hang: past the 30 s the
transport allows a request's read and write (on a loaded machine, honest streams take seconds)."""
SLOW_S = 5.0
"""Streams slower than this are counted (`slow`), not findings."""
PROBE_EVERY = 500
"""Inputs between two honest probe requests."""
WORKERS = 64
"""Concurrent streams (or publishes) in the fuzzing process, all over its one connection (yamux):
the stream surface is bound by round trips, not CPU (measured at load 6.5 on 2 cores, 1,000 inputs:
57 inputs/s with 16, 82 with 64, 72 with 256; both processes together used ~0.3 of a core)."""
RUN_ID = "fuzz-wire"


# ---- inputs ------------------------------------------------------------------------------------------

def signed(key, body: bytes, run_id: str = RUN_ID) -> bytes:
    """An envelope around arbitrary body bytes, signed as `key` would: it passes the signature check."""
    from protocol.envelope import _DOMAIN, _HEAD, FORMAT, MAGIC
    run = run_id.encode()
    head = _HEAD.pack(MAGIC, FORMAT, key.public_bytes, int(time.time() * 1000), os.urandom(16), len(run))
    unsigned = head + run + struct.pack(">I", len(body)) + body
    return unsigned + key.sign(_DOMAIN + unsigned)


def envelope_input(rng: random.Random, key, bodies: list[bytes]) -> bytes:
    """A mutated body re-signed (3 in 4) or a mutated valid envelope (1 in 4)."""
    from benchmarks.fuzz import mutate
    body = rng.choice(bodies)
    if rng.random() < 0.75:
        return signed(key, body if rng.random() < 0.1 else mutate(rng, body, bodies))
    return mutate(rng, signed(key, body), bodies)


def framed(rng: random.Random, payload: bytes) -> bytes:
    """`payload` in our length framing, the framing itself mutated half of the time."""
    frame = struct.pack(">I", len(payload)) + payload
    op = rng.randrange(12)
    if op == 0:  # length says more than follows
        return struct.pack(">I", len(payload) + rng.choice([1, 7, 4096])) + payload
    if op == 1:  # length says less than follows
        return struct.pack(">I", max(0, len(payload) - rng.choice([1, 7, 100]))) + payload
    if op == 2:  # a length over the 16 MiB frame limit, or the largest u32
        return struct.pack(">I", rng.choice([(16 << 20) + 1, 1 << 30, 2**32 - 1])) + payload[:64]
    if op == 3:
        return struct.pack(">I", 0) + payload[: rng.choice([0, 10])]
    if op == 4:  # cut inside the prefix or the body
        return frame[: rng.randrange(len(frame))]
    if op == 5:
        return frame + rng.randbytes(rng.choice([1, 16, 512]))
    if op == 6:  # two frames on one stream
        return frame + frame
    if op == 7:
        return rng.randbytes(rng.randint(0, 64))
    return frame


# ---- the fuzzing process ---------------------------------------------------------------------------

async def _exchange(host, peer_id: str, protocol: str, data: bytes) -> tuple[str, bytes]:
    """On a fresh stream: write `data`, half-close, read to the end. ('reply'|'reset'|'hang', bytes)."""
    import trio
    from libp2p.custom_types import TProtocol
    from libp2p.peer.id import ID

    async def go() -> tuple[str, bytes]:
        out = b""
        with trio.move_on_after(HANG_S):
            try:
                stream = await host._host.new_stream(ID.from_base58(peer_id), [TProtocol(protocol)])
            except Exception as exc:
                return "open_failed", repr(exc).encode()
            try:
                if data:
                    await stream.write(data)
                await stream.close()
                while True:
                    chunk = await stream.read(1 << 16)
                    if not chunk:
                        break
                    out += chunk
            except Exception:  # StreamEOF ends every reply; StreamReset is the refusal of a bad frame
                pass
            return ("reply" if out else "reset"), out
        return "hang", out
    return await host._on_trio(go)


async def _paced(host, peer_id: str, most: int = 16) -> None:
    """Wait while py-libp2p's outbound gossip queue to `peer_id` holds `most` RPCs: it holds 32 and
    silently rejects what comes beyond, so an unpaced fuzzer would mostly fuzz that queue."""
    from libp2p.peer.id import ID
    queue = host._pubsub.peer_queues.get(ID.from_base58(peer_id)) if host._pubsub else None
    for _ in range(5000):
        if queue is None or len(queue) < most:
            return
        await asyncio.sleep(0.001)


def _reply_ok(reply: bytes, coordinator: str) -> bool:
    """One frame holding an envelope signed by the coordinator, of our run."""
    from protocol.envelope import open_envelope
    from protocol.errors import ProtocolError
    if len(reply) < 4 or struct.unpack(">I", reply[:4])[0] != len(reply) - 4:
        return False
    try:
        return open_envelope(reply[4:], RUN_ID, None).signer == coordinator
    except ProtocolError:
        return False


async def client(bootstrap: str, spec_hash: str, surfaces: list[str], cases: int, seed: int,
                 workers: int = WORKERS) -> dict:
    from benchmarks.fuzz import sample_messages
    from protocol.identity import NodeKey
    from protocol.errors import Refused
    from protocol.messages import Join, LeaseBatchRequest, LeaseGrants, encode_message
    from protocol.network import RunNetwork
    from protocol.transport import PeerHost

    coordinator = bootstrap.rsplit("/p2p/", 1)[1]
    fuzz_key, probe_key = NodeKey.generate(), NodeKey.generate()
    hosts = [PeerHost(fuzz_key), PeerHost(probe_key)]
    for h in hosts:
        await h.start()
        await h.connect(bootstrap)
    fnet, pnet = RunNetwork(hosts[0], fuzz_key, RUN_ID), RunNetwork(hosts[1], probe_key, RUN_ID)
    for net in (fnet, pnet):
        await net.request(coordinator, Join(spec_hash=spec_hash, role="inference", addrs=net.host.addrs[:4]), timeout=10)
    bodies = [encode_message(m) for m in sample_messages()]
    probes_failed: list[str] = []

    async def probe() -> None:
        try:  # (re-)join first: neither member sends heartbeats, so a long run ejects them as dead
            for net in (pnet, fnet):
                try:
                    await net.request(coordinator, Join(spec_hash=spec_hash, role="inference",
                                                        addrs=net.host.addrs[:4]), timeout=10)
                except Refused as exc:
                    # the fuzzer's own seed Join, signed later, may have landed first: it is a member
                    # already, and refusing the older Join is the replay rule working; and its junk units
                    # (unpublished versions, malformed groups) are struck until it is banned: the defence
                    # working too. Only the honest probe must always be served.
                    if net is not fnet or not any(r in str(exc) for r in ("ReplayedMessage", "BannedPeer")):
                        raise
            reply = await pnet.request(coordinator, LeaseBatchRequest(policy_version=0, count=1), timeout=10)
            if not isinstance(reply, LeaseGrants):
                probes_failed.append(type(reply).__name__)
        except Exception as exc:
            probes_failed.append(f"{type(exc).__name__}: {exc}"[:200])

    result: dict = {}
    publishing = asyncio.Lock()
    for surface in surfaces:
        rng, findings, outcomes, slowest = random.Random(seed), [], {}, 0.0
        done = [0]
        if surface == "wire_gossip":
            # Join the mesh without a topic validator: py-libp2p validates our own publishes with it too,
            # and the point is to send what an honest node would never forward.
            await hosts[0].subscribe(fnet.topic)
            await asyncio.sleep(2)

        async def worker() -> None:
            nonlocal slowest
            while done[0] < cases:
                done[0] += 1
                i = done[0]
                seed_input = i <= len(bodies)  # every seed body once, signed and framed as is, first
                payload = signed(fuzz_key, bodies[i - 1]) if seed_input else envelope_input(rng, fuzz_key, bodies)
                t = time.perf_counter()
                if surface == "wire_stream":
                    data = struct.pack(">I", len(payload)) + payload if seed_input else framed(rng, payload)
                    kind, reply = await _exchange(hosts[0], coordinator, fnet.rpc_protocol, data)
                    if kind == "reply" and not _reply_ok(reply, coordinator):
                        kind = "bad_reply"
                    if kind in ("hang", "bad_reply", "open_failed"):
                        findings.append({"kind": kind, "input": data[:300].hex(), "reply": reply[:200].hex()})
                else:
                    kind = "published"
                    try:
                        async with publishing:  # one at a time, so the pacing sees the queue it fills
                            await _paced(hosts[0], coordinator)
                            await hosts[0].publish(fnet.topic, payload)
                    except Exception as exc:
                        kind = "publish_failed"
                        findings.append({"kind": f"publish failed: {exc}"[:200], "input": payload[:300].hex()})
                outcomes[kind] = outcomes.get(kind, 0) + 1
                if time.perf_counter() - t > SLOW_S:
                    outcomes["slow"] = outcomes.get("slow", 0) + 1
                slowest = max(slowest, time.perf_counter() - t)
                if i % PROBE_EVERY == 0:
                    await probe()
                if i % 20_000 == 0:
                    log.info("%s: %d/%d inputs, %d findings", surface, i, cases, len(findings))

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(workers)])
        wall = time.perf_counter() - t0
        if surface == "wire_gossip":
            await asyncio.sleep(3)  # publishes are queued in libp2p; let them leave before the host stops
        await probe()
        result[surface] = {"inputs": cases, "inputs_per_s": round(cases / wall, 1), "findings": len(findings),
                           "finding_examples": findings[:5], "slowest_s": round(slowest, 4), "wall_s": round(wall, 1),
                           "outcomes": outcomes, "concurrent": workers}
    result["probes_failed"] = probes_failed
    for h in hosts:
        await h.stop()
    return result


# ---- the coordinator side ---------------------------------------------------------------------------

class _Errors(logging.Handler):
    """Counts records at ERROR or above (log.exception in a handler, a crashed task), and how the
    coordinator's gossip path disposed of each fuzzed message (from its INFO records)."""

    GOSSIP = {"gossip from": "dropped_by_validator", "gossip via": "refused_at_open", "gossip ": "refused_by_handler"}

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[str] = []
        self.gossip: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            self.records.append(f"{record.name}: {record.getMessage()}"[:300])
        elif record.name == "protocol.network" and isinstance(record.msg, str):
            kind = next((v for k, v in self.GOSSIP.items() if record.msg.startswith(k)), None)
            if kind:
                self.gossip[kind] = self.gossip.get(kind, 0) + 1


async def run_wire(surfaces: list[str], cases: int, seed: int, directory: Path, timeout: float | None = None,
                   planted_bug: bool = False, workers: int = WORKERS) -> dict:
    """Start a coordinator here, fuzz it from a child process, and judge both sides. `planted_bug`:
    the coordinator also answers `Ok` requests with a handler that raises (the harness must see it)."""
    from protocol.coordinator import Coordinator
    from protocol.coordinator_service import CoordinatorService
    from protocol.identity import NodeKey
    from protocol.limits import LimitConfig
    from protocol.messages import RunSpec
    from protocol.transport import GossipConfig, PeerHost

    errors = _Errors()
    logging.getLogger().addHandler(errors)
    for noisy in ("protocol.transport", "protocol.coordinator_service", "protocol.coordinator"):
        logging.getLogger(noisy).setLevel(logging.ERROR)  # every refused input logs at INFO/WARNING
    net_log = logging.getLogger("protocol.network")  # counted by `errors`, not printed
    net_log.setLevel(logging.INFO)
    net_log.propagate = False
    net_log.addHandler(errors)
    delivered = [0]

    async def count(_opened) -> None:
        delivered[0] += 1
    key = NodeKey.generate()
    spec = RunSpec(run_id=RUN_ID, coordinator=key.peer_id, batch_groups=4, group_size=2)
    host = PeerHost(key, gossip=GossipConfig(max_messages_per_peer_per_s=1e9),
                    limits=LimitConfig(rate_per_s=1e9, burst=1e9, max_inflight=10**6, max_total_inflight=10**6))
    await host.start()
    svc = CoordinatorService(key, Coordinator(directory, spec, synchronous="OFF"), host)
    svc.net.on_gossip(count)
    await svc.start()
    if planted_bug:
        from protocol.messages import Ok

        async def boom(_opened):
            raise RuntimeError("planted")
        svc.net.serve(Ok, boom)
    svc.state.advance_policy(0, "00" * 32, time.time())
    bootstrap = host.addrs[0] if "/p2p/" in host.addrs[0] else f"{host.addrs[0]}/p2p/{key.peer_id}"
    cmd = [sys.executable, "-m", "benchmarks.fuzz_wire", "client", "--bootstrap", bootstrap,
           "--spec-hash", svc.state.spec_hash, "--cases", str(cases), "--seed", str(seed), "--workers", str(workers),
           "--only", *surfaces]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE, env={**os.environ})
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    seen, quiet = -1, 0  # let the last gossip reach the handlers: until nothing new for 2 s (at most 60 s)
    for _ in range(120):
        now_seen = sum(errors.gossip.values()) + delivered[0]
        quiet = quiet + 1 if now_seen == seen else 0
        if quiet >= 4:
            break
        seen = now_seen
        await asyncio.sleep(0.5)
    result = json.loads(out.decode().strip().splitlines()[-1]) if proc.returncode == 0 else {}
    result["client_exit"] = proc.returncode
    result["coordinator"] = {"refused": dict(svc.net.refused), "error_logs": len(errors.records),
                             "error_examples": errors.records[:5],
                             "gossip": {**errors.gossip, "delivered_to_handlers": delivered[0]}}
    for s in surfaces:
        if s in result:  # findings on the coordinator's side count against every surface that ran
            result[s]["findings"] += svc.net.refused.get("InternalError", 0) + len(errors.records)
    if "wire_gossip" in result:  # every published input reached the coordinator and was disposed of
        accounted = sum(errors.gossip.values()) + delivered[0]
        result["wire_gossip"]["accounted_at_coordinator"] = accounted
    logging.getLogger().removeHandler(errors)
    net_log.removeHandler(errors)
    net_log.propagate = True
    await svc.stop()
    svc.state.close()
    await host.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="run", choices=["run", "client"])
    ap.add_argument("--bootstrap", help="client: the coordinator's multiaddr")
    ap.add_argument("--spec-hash", help="client: the run spec hash to join with")
    ap.add_argument("--cases", type=int, default=100_000, help="inputs per surface")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=WORKERS, help="concurrent streams (or publishes)")
    ap.add_argument("--only", nargs="*", default=["wire_stream", "wire_gossip"])
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    if args.mode == "client":
        for noisy in ("protocol.transport", "protocol.network"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
        print(json.dumps(asyncio.run(client(args.bootstrap, args.spec_hash, args.only, args.cases, args.seed,
                                                args.workers))))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(asyncio.run(run_wire(args.only, args.cases, args.seed, Path(tmp), workers=args.workers))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
