"""One test per defect the fuzzers found (docs/chaos.md lists them)."""

from __future__ import annotations

import json

from benchmarks import fuzz
from protocol.envelope import open_envelope
from protocol.messages import Refusal, RolloutSubmission, encode_message


def _submission_body(work_id: int) -> bytes:
    sub = next(m for m in fuzz.sample_messages() if isinstance(m, RolloutSubmission))
    body = json.loads(encode_message(sub))
    body["work_id"] = work_id
    return json.dumps(body, separators=(",", ":")).encode()


def test_work_id_beyond_int64_is_malformed_not_an_internal_error_in_the_store(tmp_path):
    """benchmarks.fuzz, coordinator_rpc, seed 0: a signed submission with work_id 10^30 passed the
    schema (ge=0 only) and raised OverflowError in SQLite inside the handler. Every integer field
    is now bounded by MAX_INT64, so it is refused as MalformedMessage before any handler runs."""
    s = fuzz.CoordinatorRpcSurface(tmp_path)
    try:
        replies = {}
        for name, wid in {"huge": 10**30, "int64_max_plus_1": 1 << 63, "honest_unknown": 12345}.items():
            s.check(_submission_body(wid))  # raises fuzz.Finding on an InternalError
            env = s.loop.run_until_complete(s.svc.net._on_request(s.member.peer_id, _sealed(s, wid)))
            msg = open_envelope(env, "fuzz", None).message
            replies[name] = msg.reason if isinstance(msg, Refusal) else msg.type
        assert s.svc.net.refused["InternalError"] == 0
    finally:
        s.close()
    assert replies["huge"] == replies["int64_max_plus_1"] == "MalformedMessage"
    assert replies["honest_unknown"] == "UnknownLease"  # a well-formed one reaches the lease check


def _sealed(s: fuzz.CoordinatorRpcSurface, work_id: int) -> bytes:
    import os
    import struct
    import time

    from protocol.envelope import _DOMAIN, _HEAD, FORMAT, MAGIC
    body = _submission_body(work_id)
    head = _HEAD.pack(MAGIC, FORMAT, s.member.public_bytes, int(time.time() * 1000), os.urandom(16), 4)
    unsigned = head + b"fuzz" + struct.pack(">I", len(body)) + body
    return unsigned + s.member.sign(_DOMAIN + unsigned)
