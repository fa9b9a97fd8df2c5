"""Every listening surface keeps its property under fuzzed input (a short run of benchmarks.fuzz;
the 100,000-input run per surface is `python -m benchmarks.fuzz`), and honest input still passes."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks import fuzz


@pytest.fixture(autouse=True)
def _quiet_logs():
    import logging
    for name in ("protocol.network", "protocol.coordinator_service", "protocol.coordinator", "aiohttp"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _assert_clean(result: dict, cases: int) -> None:
    assert result["inputs"] == cases
    assert result["findings"] == 0, result["finding_examples"]
    assert result["slowest_s"] < fuzz.HANG_S


def test_envelope_decoder_refuses_fuzz_with_typed_errors_and_opens_honest_envelopes():
    from protocol.envelope import open_envelope
    s = fuzz.EnvelopeSurface()
    assert all(open_envelope(seed, "fuzz", None, now=s.now).message for seed in s.seeds)
    _assert_clean(fuzz.run_surface(s, 3000, seed=11, progress=False), 3000)


def test_message_decoder_refuses_fuzz_with_typed_errors_and_decodes_every_honest_type():
    from protocol.messages import decode_message
    s = fuzz.MessageBodySurface()
    assert len({decode_message(seed).type for seed in s.seeds}) == len(s.seeds)
    _assert_clean(fuzz.run_surface(s, 3000, seed=12, progress=False), 3000)


def test_coordinator_request_handler_answers_every_fuzzed_request_without_an_internal_error(tmp_path):
    s = fuzz.CoordinatorRpcSurface(tmp_path)
    try:
        _assert_clean(fuzz.run_surface(s, 1500, seed=13, progress=False), 1500)
        # honest requests from the joined member are still served after the fuzz
        from protocol.envelope import open_envelope, seal
        from protocol.messages import LeaseBatchRequest, LeaseGrants
        reply = s.loop.run_until_complete(s.svc.net._on_request(
            s.member.peer_id, seal(s.member, "fuzz", LeaseBatchRequest(policy_version=0, count=2))))
        assert isinstance(open_envelope(reply, "fuzz", None).message, LeaseGrants)
    finally:
        s.close()


def test_manifest_decoder_refuses_fuzz_and_verifies_honest_manifests(tmp_path):
    from shardcast.manifest import SignedManifest
    s = fuzz.ManifestSurface(tmp_path)
    assert [SignedManifest.from_json(seed).verified(s.trusted).version for seed in s.seeds] == [0, 1]
    _assert_clean(fuzz.run_surface(s, 3000, seed=14, progress=False), 3000)


def test_shard_decoder_raises_only_corrupt_shard_on_fuzzed_wire_bytes(tmp_path):
    s = fuzz.ShardSurface(tmp_path)
    _assert_clean(fuzz.run_surface(s, 3000, seed=15, progress=False), 3000)


@pytest.mark.parametrize("name", ["http_shardcast", "http_status"])
def test_http_servers_answer_fuzzed_requests_without_5xx_or_hangs(tmp_path, name):
    app = fuzz.shardcast_app(tmp_path) if name == "http_shardcast" else fuzz.status_app(tmp_path)
    surface = fuzz.HttpSurface(name, app, "/shardcast/runs" if name == "http_shardcast" else "/status.json")
    r = asyncio.run(asyncio.wait_for(fuzz.run_http(surface, 1500, seed=16), 120))
    assert r["findings"] == 0, r["finding_examples"]
    assert r["statuses"].get(200, 0) > 0 and r["statuses"].get(404, 0) > 0  # honest requests served, junk refused
