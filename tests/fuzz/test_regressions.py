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


def test_non_utf8_expect_header_gets_417_not_500(tmp_path):
    """benchmarks.fuzz, http_shardcast, seed 0: `Expect: 100\\xc4p-continue` made aiohttp's default
    Expect handler raise UnicodeEncodeError (a 500). The shard server's own handler answers 417,
    and a proper `Expect: 100-continue` still gets its 100 Continue and then the answer."""
    import asyncio

    from aiohttp import web

    async def body():
        app, cleanup = await fuzz.shardcast_app(tmp_path)()
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        answers = []
        for expect in ["100\xc4p-continue", "\xff-continue", "100-continue"]:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(f"GET /shardcast/runs HTTP/1.1\r\nHost: x\r\nConnection: close\r\nExpect: {expect}\r\n\r\n"
                    .encode("latin-1"))
            answers.append(await asyncio.wait_for(r.read(), 5))
            w.close()
        await runner.cleanup()
        await cleanup()
        return answers
    bad1, bad2, good = asyncio.run(asyncio.wait_for(body(), 30))
    assert bad1.startswith(b"HTTP/1.1 417") and bad2.startswith(b"HTTP/1.1 417")
    assert good.startswith(b"HTTP/1.1 100 Continue") and b"HTTP/1.1 200 OK" in good and b'"runs"' in good
