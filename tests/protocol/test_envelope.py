"""Signed envelopes: honest messages pass; forged, replayed, expired, foreign, oversized,
truncated and random input is refused with a typed reason (and nothing else escapes)."""

from __future__ import annotations

import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.envelope import MAX_ENVELOPE_BYTES, ReplayGuard, open_envelope, seal
from protocol.errors import (ExpiredMessage, InvalidSignature, MalformedMessage, MessageTooLarge, ProtocolError,
                             ReplayedMessage, WrongRun)
from protocol.identity import NodeKey
from protocol.messages import (MESSAGE_TYPES, BatchRejects, BatchRequest, JoinAgain, LeaseBatchRequest, LeaseGrants, PublishPolicy, RolloutGroup,
                               StoredWork, StoredWorkBatch, VerdictBatch, VerifyRequest, Ban, Heartbeat, Join, JoinAccepted, LeaseGrant, Leave, Ok,
                               PeerAddress, PolicyAnnounce, Refusal, RolloutSubmission, RunEnd, RunSpec, SubmissionReceipt,
                               UnitFailure, Verdict, WorkCancel, decode_message, encode_message)

KEY = NodeKey.from_seed(b"k" * 32)
OTHER = NodeKey.from_seed(b"o" * 32)
RUN = "fuzz-run"
SPEC = RunSpec(run_id=RUN, coordinator=KEY.peer_id)
SAMPLES = {
    RunSpec: SPEC,
    Join: Join(spec_hash=SPEC.spec_hash(), role="inference", addrs=["/ip4/127.0.0.1/tcp/4001"]),
    JoinAccepted: JoinAccepted(spec=SPEC, policy_version=3, members=[PeerAddress(peer_id=OTHER.peer_id, addrs=["/ip4/1.2.3.4/tcp/1"])]),
    Heartbeat: Heartbeat(seq=7, role="validator", addrs=["/ip4/127.0.0.1/tcp/4002"]),
    Leave: Leave(reason="bye"),
    RunEnd: RunEnd(step=500),
    PolicyAnnounce: PolicyAnnounce(version=4, manifest_hash="ab" * 32),
    LeaseGrant: LeaseGrant(work_id=9, holder=OTHER.peer_id, policy_version=4, task_index=12, seed=2**63, deadline=1e9),
    RolloutSubmission: RolloutSubmission(work_id=9, version_runs=[(3, 2), (4, 2)], token_ids=[5, 6, 7, 8],
                                         logprobs=[-0.1, -2.0, 0.0, -0.3], reward=0.5, proof=bytes(range(64)),
                                         finish_reason="length"),
    SubmissionReceipt: SubmissionReceipt(work_id=9, accepted=True),
    Refusal: Refusal(reason="StaleRollout", detail="lag 3 > 2"),
    WorkCancel: WorkCancel(work_ids=[1, 2, 3], policy_version=5),
    Verdict: Verdict(work_id=9, submitter=OTHER.peer_id, valid=False, reason="proof mismatch"),
    Ban: Ban(peer_id=OTHER.peer_id, reason="forged proofs", until=None),
    Ok: Ok(),
    RolloutGroup: RolloutGroup(work_id=9, rollouts=[RolloutSubmission(
        work_id=9, version_runs=[(4, 2)], token_ids=[5, 6], logprobs=[-0.1, -2.0], reward=1.0,
        finish_reason="eos", sampled=[True, True])] * 2),
    LeaseBatchRequest: LeaseBatchRequest(policy_version=4, count=16),
    LeaseGrants: LeaseGrants(grants=[LeaseGrant(work_id=9, holder=OTHER.peer_id, policy_version=4, task_index=12,
                                                seed=7, deadline=1e9)]),
    BatchRequest: BatchRequest(step=5, groups=64),
    VerifyRequest: VerifyRequest(max_items=32),
    StoredWorkBatch: StoredWorkBatch(step=5, items=[StoredWork(work_id=9, task_index=1, seed=2, envelope=b"x" * 40)]),
    VerdictBatch: VerdictBatch(verdicts=[Verdict(work_id=9, submitter=OTHER.peer_id, valid=True)]),
    PublishPolicy: PublishPolicy(version=5, manifest_hash="cd" * 32),
    BatchRejects: BatchRejects(step=5, failures=[UnitFailure(work_id=9, reason="a group of 1 rollouts, the run's have 2")]),
    JoinAgain: JoinAgain(peer_id=OTHER.peer_id, heartbeat_seq=12, reason="ejected as dead"),
}
FUZZ_CASES = 10_000


def test_every_message_type_round_trips_through_a_signed_envelope():
    assert set(SAMPLES) == set(MESSAGE_TYPES)
    guard = ReplayGuard()
    for msg in SAMPLES.values():
        opened = open_envelope(seal(KEY, RUN, msg), RUN, guard)
        assert opened.message == msg and opened.signer == KEY.peer_id


def test_forged_signature_is_refused():
    data = bytearray(seal(KEY, RUN, SAMPLES[Heartbeat]))
    data[-1] ^= 1
    with pytest.raises(InvalidSignature):
        open_envelope(bytes(data), RUN)
    # Someone else's signature over the same bytes, claiming KEY as signer.
    good = seal(KEY, RUN, SAMPLES[Heartbeat])
    forged = good[:-64] + OTHER.sign(b"primerl-node/envelope/v1\x00" + good[:-64])
    with pytest.raises(InvalidSignature):
        open_envelope(forged, RUN)
    # Swapping the signer field for another key breaks the signature too.
    swapped = good[:5] + OTHER.public_bytes + good[37:]
    with pytest.raises(InvalidSignature):
        open_envelope(swapped, RUN)


def test_replayed_envelope_is_refused_but_a_fresh_one_passes():
    guard = ReplayGuard()
    data = seal(KEY, RUN, SAMPLES[LeaseBatchRequest])
    open_envelope(data, RUN, guard)
    with pytest.raises(ReplayedMessage):
        open_envelope(data, RUN, guard)
    open_envelope(seal(KEY, RUN, SAMPLES[LeaseBatchRequest]), RUN, guard)  # same content, new nonce


def test_expired_and_future_timestamps_are_refused():
    now = time.time()
    with pytest.raises(ExpiredMessage):
        open_envelope(seal(KEY, RUN, Ok(), now=now - 600), RUN, now=now)
    with pytest.raises(ExpiredMessage):
        open_envelope(seal(KEY, RUN, Ok(), now=now + 600), RUN, now=now)
    open_envelope(seal(KEY, RUN, Ok(), now=now - 60), RUN, now=now)  # inside the window


def test_wrong_run_is_refused():
    with pytest.raises(WrongRun):
        open_envelope(seal(KEY, "another-run", Ok()), RUN)


def test_oversized_input_is_refused_before_parsing():
    with pytest.raises(MessageTooLarge):
        open_envelope(b"\0" * (MAX_ENVELOPE_BYTES + 1), RUN)
    # A heartbeat padded with JSON whitespace beyond its type's limit: valid JSON, still refused.
    body = encode_message(SAMPLES[Heartbeat])[:-1] + b" " * 70_000 + b"}"
    with pytest.raises(MessageTooLarge):
        decode_message(body)
    # A header claiming a huge body.
    good = seal(KEY, RUN, Ok())
    pos = 4 + 1 + 32 + 8 + 16 + 1 + len(RUN)
    with pytest.raises(MessageTooLarge):
        open_envelope(good[:pos] + struct.pack(">I", 1 << 30) + good[pos + 4:], RUN)


def test_every_truncation_is_refused():
    data = seal(KEY, RUN, SAMPLES[RolloutSubmission])
    for n in range(len(data)):
        with pytest.raises(MalformedMessage):
            open_envelope(data[:n], RUN)


def test_signed_but_malformed_bodies_are_refused():
    """The signature only says who sent it; the body is still checked field by field."""
    bad = [b"", b"{}", b"[]", b"null", b'{"type":"nope","v":1}', b'{"type":"heartbeat","v":2,"seq":1,"role":"inference"}',
           b'{"type":"heartbeat","v":1,"seq":-1,"role":"inference"}', b"\xff\xfe", b"[" * 100_000,
           encode_message(SAMPLES[Heartbeat])[:-1] + b',"extra":1}',
           b'{"type":"rollout_submission","v":1,"work_id":1,"version_runs":[[0,3]],"token_ids":[1,2],'
           b'"logprobs":[-1,-1],"reward":0,"finish_reason":"eos"}',  # runs do not cover the tokens
           b'{"type":"rollout_submission","v":1,"work_id":1,"version_runs":[[0,1]],"token_ids":[1],'
           b'"logprobs":[-1],"reward":NaN,"finish_reason":"eos"}']
    for body in bad:
        with pytest.raises((MalformedMessage, MessageTooLarge)):
            decode_message(body)


def _mutate(data: bytes, rng) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if not out:
            break
        pos, kind = rng.randrange(len(out)), rng.randrange(5)
        if kind == 0:
            out[pos] = rng.randrange(256)
        elif kind == 1:
            out[pos] ^= 1 << rng.randrange(8)
        elif kind == 2:
            del out[pos:pos + rng.randint(1, 8)]
        elif kind == 3:
            out[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        else:
            del out[pos:]
    return bytes(out)


CASES_PER_EXAMPLE = 10
_FUZZ = settings(max_examples=FUZZ_CASES // CASES_PER_EXAMPLE, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))


@pytest.mark.slow
@pytest.mark.parametrize("mtype", MESSAGE_TYPES, ids=lambda t: t.__name__)
def test_fuzzed_input_of_every_message_type_is_refused_or_valid(mtype):
    """10,000 cases per type (1,000 Hypothesis examples x 10 seeded mutations each, which keeps
    Hypothesis' per-example overhead affordable): mutated signed bodies (past the signature, into
    the decoder), mutated whole envelopes, and random bytes. Only typed ProtocolErrors come out."""
    body = encode_message(SAMPLES[mtype])
    envelope = seal(KEY, RUN, SAMPLES[mtype])
    counts = {"valid": 0, "refused": 0}

    @_FUZZ
    @given(rng=st.randoms(use_true_random=False), noise=st.binary(max_size=512))
    def case(rng, noise):
        for i in range(CASES_PER_EXAMPLE):
            try:
                which = i % 3
                if which == 0:
                    decode_message(_mutate(body, rng))  # what a hostile but signed-in peer can reach
                elif which == 1:
                    open_envelope(_mutate(envelope, rng), RUN)
                else:
                    open_envelope(envelope[:rng.randrange(80)] + noise[:rng.randrange(len(noise) + 1)], RUN)
                counts["valid"] += 1
            except ProtocolError:
                counts["refused"] += 1
    case()
    assert counts["valid"] + counts["refused"] >= FUZZ_CASES
    assert counts["refused"] > FUZZ_CASES // 2
