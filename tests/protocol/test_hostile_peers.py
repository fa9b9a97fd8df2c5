"""Hostile input over real libp2p streams and gossip: each is refused with a typed reason and the
coordinator keeps serving honest members."""

from __future__ import annotations

import asyncio
import struct

from protocol_testnet import (WAIT_S, client, eventually, make_spec, run, start_coordinator, start_member,
                              stop_all)

from protocol.envelope import open_envelope, seal
from protocol.errors import DuplicateSubmission, MessageTooLarge, LeaseExpired, StaleRollout, TransportError
from protocol.identity import NodeKey
from protocol.messages import LeaseBatchRequest, Refusal, RolloutSubmission
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from protocol.transport import PeerHost


def rollout(work_id: int, version: int, n: int = 4) -> RolloutSubmission:
    return RolloutSubmission(work_id=work_id, version_runs=[(version, n)], token_ids=[3] * n, logprobs=[-1.0] * n,
                             reward=1.0, finish_reason="eos")


def test_bad_requests_are_refused_with_reasons_and_the_coordinator_keeps_serving(tmp_path):
    async def body():
        ck = NodeKey.generate()
        spec = make_spec(ck, run_id="hostile", heartbeat_interval_s=1.0, max_off_policy_steps=1, batch_groups=8)
        coord = await start_coordinator(tmp_path, ck, spec)
        await coord.announce_policy(0, "aa" * 32)
        honest = await start_member(spec, coord.host.addrs[0])
        evil_key = NodeKey.generate()
        evil = PeerHost(evil_key)
        await evil.start()
        try:
            await evil.connect(coord.host.addrs[0])
            proto = coord.net.rpc_protocol

            async def raw(data: bytes) -> str:
                reply = await evil.request(ck.peer_id, proto, data, timeout=5)
                msg = open_envelope(reply, spec.run_id).message
                assert isinstance(msg, Refusal)
                return msg.reason

            good = seal(evil_key, spec.run_id, LeaseBatchRequest(policy_version=0, count=1))
            forged = good[:-1] + bytes([good[-1] ^ 1])
            reasons = [
                await raw(b""),
                await raw(b"\x00" * 1000),
                await raw(good[:50]),
                await raw(forged),
                await raw(seal(evil_key, "another-run", LeaseBatchRequest(policy_version=0, count=1))),
                await raw(seal(evil_key, spec.run_id, LeaseBatchRequest(policy_version=0, count=1), now=1.0)),
                await raw(seal(honest.key, spec.run_id, LeaseBatchRequest(policy_version=0, count=1))),  # not the stream's peer
                await raw(good),  # valid envelope, but evil never joined
                await raw(good),  # the same bytes again
            ]
            assert reasons == ["MalformedMessage", "MalformedMessage", "MalformedMessage", "InvalidSignature",
                               "WrongRun", "ExpiredMessage", "SignerMismatch", "NotMember", "ReplayedMessage"]
            # A frame whose length prefix claims 1 GiB: the stream is reset before anything is buffered.
            async def huge_frame() -> bytes:
                stream = await evil._host.new_stream(ID.from_base58(ck.peer_id), [TProtocol(proto)])
                await stream.write(struct.pack(">I", 1 << 30) + b"x" * 100)
                try:
                    return await stream.read(10)
                except Exception:
                    return b""
            assert await evil._on_trio(huge_frame) == b""
            # A reply bigger than the caller's limit is refused on the caller's side too.
            try:
                await evil.request(ck.peer_id, proto, b"", timeout=5, max_reply=1)
                raise AssertionError("reply larger than the limit was accepted")
            except MessageTooLarge as exc:
                assert "exceeds" in str(exc)

            # Submissions: stale, duplicate, late: each refused with its reason, honest ones accepted.
            coordinator = client(honest)
            g, = await coordinator.lease(1, holds_version=0)
            assert (await coordinator.submit(rollout(g.work_id, 0))).accepted
            assert (await coordinator.submit(rollout(g.work_id, 0))).duplicate  # idempotent retry
            try:
                await coordinator.submit(rollout(g.work_id, 0, n=5))
                raise AssertionError("second different result accepted")
            except DuplicateSubmission as exc:
                assert exc.reason == "DuplicateSubmission"
            g2, = await coordinator.lease(1, holds_version=0)
            await coord.announce_policy(1, "bb" * 32)
            await coord.announce_policy(2, "cc" * 32)  # g2 (minted at 0) can no longer finish: cancelled
            await eventually(lambda: g2.work_id in honest.cancelled, WAIT_S, "cancel gossiped")
            try:
                await coordinator.submit(rollout(g2.work_id, 0))
                raise AssertionError("cancelled lease accepted")
            except LeaseExpired:
                pass
            g3, = await coordinator.lease(1, holds_version=2)
            assert g3.work_id == g2.work_id and g3.policy_version == 2
            try:
                await coordinator.submit(rollout(g3.work_id, 0))  # lag 2 > k=1
                raise AssertionError("stale rollout accepted")
            except StaleRollout:
                pass
            # the refused unit went back to the pool at once (it holds none of the peer's lease cap): leased again
            g4, = await coordinator.lease(1, holds_version=2)
            assert g4.work_id == g3.work_id
            assert (await coordinator.submit(rollout(g4.work_id, 2))).accepted

            # Gossip garbage from the evil peer is dropped before delivery and forwarding.
            gossip = await evil.subscribe(coord.net.topic)
            await gossip.get(WAIT_S)  # gossip (the coordinator's beats) reaches it: the mesh is up
            for junk in (b"junk", forged, seal(evil_key, "another-run", LeaseBatchRequest(policy_version=0, count=1))):
                await evil.publish(coord.net.topic, junk)
            await coord.announce_policy(3, "dd" * 32)
            await eventually(lambda: honest.policy_version == 3, WAIT_S, "honest announce after junk")
            assert sorted(r.work_id for r in coord.state.accepted_rollouts()) == [g.work_id, g2.work_id]
            assert sum(coord.net.refused.values()) >= 9
        finally:
            await evil.stop()
            await stop_all(coord, [honest])
    run(body())


def test_unreachable_peer_times_out_with_a_typed_error():
    async def body():
        a = PeerHost(NodeKey.generate())
        await a.start()
        try:
            ghost = NodeKey.generate().peer_id
            try:
                await a.connect(f"/ip4/127.0.0.1/tcp/1/p2p/{ghost}", timeout=2)
                raise AssertionError("connected to a closed port")
            except TransportError:
                pass
            try:
                await a.request(ghost, "/x/1", b"hi", timeout=2)
                raise AssertionError("request to an unknown peer returned")
            except TransportError:
                pass
        finally:
            await a.stop()
    run(body())
