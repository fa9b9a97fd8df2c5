"""A live member is never left ejected (issue 28: `make run`'s validator was ejected 33 s after joining and the
coordinator refused its heartbeats for the rest of the run, 480+ log lines, while it went on working).

A member the coordinator no longer counts learns it, from a signed `JoinAgain` gossiped when its heartbeat is
refused, or from a `NotMember` answer to its next request, and joins again; the refusal is logged once per
peer per heartbeat interval; a member's first heartbeat is due from its join, with a grace for slow starts.
Real libp2p hosts and a real coordinator store on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import time

from protocol_testnet import eventually, make_spec, run, start_coordinator, start_member, stop_all

from protocol.client import CoordinatorClient, Retry
from protocol.coordinator import Coordinator
from protocol.identity import NodeKey
from protocol.membership import FIRST_BEAT_GRACE
from protocol.messages import Join

INTERVAL = 0.3
DEAD_AFTER = 3


@pytest.fixture(autouse=True)
def _protocol_logs_reach_caplog():
    """These tests count log lines: a test earlier in the run may have disabled or detached the protocol's
    loggers (logging.config, a CLI's quieting); they pass alone and failed after the whole suite."""
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith(("protocol", "node")) and isinstance(logger, logging.Logger):
            logger.disabled, logger.propagate = False, True
            logger.setLevel(logging.NOTSET)
    yield


def _refusal_lines(caplog, peer_id: str, records=None) -> int:
    return sum("refused" in r.getMessage() and peer_id in r.getMessage() and "heartbeat" in r.getMessage()
               for r in (caplog.records if records is None else records))


def test_a_member_whose_heartbeats_are_refused_joins_again_and_the_refusal_is_logged_once_per_interval(
        tmp_path, caplog):
    caplog.set_level(logging.INFO)

    async def body():
        ck = NodeKey.generate()
        spec = make_spec(ck, heartbeat_interval_s=INTERVAL, dead_after_missed=DEAD_AFTER)
        coord = await start_coordinator(tmp_path, ck, spec, policy_version=0)
        boot = coord.host.addrs[0]
        member = await start_member(spec, boot, role="validator")
        peer = member.key.peer_id
        try:
            await eventually(lambda: coord.state.view.members.get(peer) is not None
                             and coord.state.view.members[peer].beats > 0, 10, "a first heartbeat")
            member._beating.cancel()  # its loop stalls (a long load under load): no beat, no request
            await eventually(lambda: peer not in coord.state.view.members, 10, "the silent member's ejection")
            refused_from = len(caplog.records)
            member._beating = asyncio.create_task(member._beat())  # the loop runs again: it beats as before
            member._tasks.append(member._beating)
            await eventually(lambda: peer in coord.state.view.members, 10, "the member back in the view")
            assert member.rejoins == 1
            # it stays in: later beats are accepted, nobody refuses them, for more beats than its ejection
            # would take (counted in the coordinator's accepted beats: a loaded machine is slow, not silent)
            beats = lambda: coord.state.view.members[peer].beats if peer in coord.state.view.members else -1
            await eventually(lambda: beats() >= DEAD_AFTER * FIRST_BEAT_GRACE + 1, 10, "the re-joined member's beats",
                             progress=beats)
            assert coord.state.view.state(peer, time.time()) == "alive"
            assert member.rejoins == 1
            lines = _refusal_lines(caplog, peer, caplog.records[refused_from:])
            assert 1 <= lines <= 2, lines  # the beat that told it, perhaps one more sent before it re-joined
        finally:
            await stop_all(coord, [member])
    run(body(), 60)


def test_refused_heartbeats_of_a_member_that_cannot_rejoin_are_logged_once_per_interval(tmp_path, caplog):
    """A peer that keeps beating without being a member (it never joined this coordinator): one line per
    heartbeat interval, not one per beat, however fast it beats."""
    caplog.set_level(logging.INFO)

    async def body():
        ck = NodeKey.generate()
        spec = make_spec(ck, heartbeat_interval_s=INTERVAL, dead_after_missed=DEAD_AFTER)
        coord = await start_coordinator(tmp_path, ck, spec, policy_version=0)
        member = await start_member(spec, coord.host.addrs[0], role="relay")
        peer = member.key.peer_id
        try:
            member._beating.cancel()
            member._bootstrap = None  # it cannot join again: its beats go on being refused
            coord.state.leave(peer, time.time())
            from protocol.messages import Heartbeat

            t0 = time.monotonic()
            for seq in range(100, 130):  # 30 beats in ~1.5 s: ten times the run's pace
                await member.net.gossip(Heartbeat(seq=seq, role="relay", addrs=[]))
                await asyncio.sleep(0.05)  # the fast beating under test, not a wait
            await eventually(lambda: _refusal_lines(caplog, peer) >= 1, 10, "a refused beat logged")
            elapsed = time.monotonic() - t0
            lines = _refusal_lines(caplog, peer)
            assert 1 <= lines <= elapsed / INTERVAL + 1, (lines, elapsed)
            assert member.rejoins == 0 and peer not in coord.state.view.members
        finally:
            await stop_all(coord, [member])
    run(body(), 60)


def test_an_ejected_validator_learns_it_from_its_next_request_and_joins_again(tmp_path):
    async def body():
        ck, vk = NodeKey.generate(), NodeKey.generate()
        spec = make_spec(ck, heartbeat_interval_s=INTERVAL, dead_after_missed=DEAD_AFTER, validators=[vk.peer_id])
        coord = await start_coordinator(tmp_path, ck, spec, policy_version=0)
        boot = coord.host.addrs[0]
        member = await start_member(spec, boot, role="validator", key=vk)
        try:
            member._beating.cancel()
            member.net._gossip_handlers.clear()  # and it hears no gossip either: only its requests tell it
            await eventually(lambda: vk.peer_id not in coord.state.view.members, 10, "the validator's ejection")
            client = CoordinatorClient(member, boot, retry=Retry(tries=3, first_delay_s=0.05))
            assert await client.to_verify(8) == []
            assert vk.peer_id in coord.state.view.members
            assert member.rejoins == 1
        finally:
            await stop_all(coord, [member])
    run(body(), 60)


def test_the_first_heartbeat_is_due_from_the_join_with_a_grace_and_the_log_says_so(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    ck = NodeKey.generate()
    spec = make_spec(ck, heartbeat_interval_s=2.0, dead_after_missed=3)
    state = Coordinator(tmp_path, spec, now=0.0)
    try:
        slow, quick = NodeKey.generate().peer_id, NodeKey.generate().peer_id
        for peer in (slow, quick):
            state.join(peer, Join(spec_hash=spec.spec_hash(), role="validator"), now=1000.0)
        from protocol.messages import Heartbeat

        state.heartbeat(quick, Heartbeat(seq=1, role="validator"), now=1000.5)
        # 3 missed beats (7 s of silence) eject a member that has beaten; one still starting has twice that
        dead, _ = state.sweep(1000.5 + 8.0)
        assert dead == [quick]
        assert state.sweep(1000.0 + 10.0)[0] == []
        dead, _ = state.sweep(1000.0 + 2.0 * (3 * FIRST_BEAT_GRACE + 0.5) + 0.1)
        assert dead == [slow]
        said = [r.getMessage() for r in caplog.records if slow in r.getMessage() and "ejected" in r.getMessage()]
        assert len(said) == 1 and "since it joined" in said[0] and "no heartbeat" in said[0]
    finally:
        state.close()


def test_a_banned_peer_that_keeps_beating_is_not_asked_back(tmp_path, caplog):
    caplog.set_level(logging.INFO)

    async def body():
        ck = NodeKey.generate()
        spec = make_spec(ck, heartbeat_interval_s=INTERVAL, dead_after_missed=DEAD_AFTER)
        coord = await start_coordinator(tmp_path, ck, spec, policy_version=0)
        member = await start_member(spec, coord.host.addrs[0])
        member.on_end.clear()
        peer = member.key.peer_id
        try:
            coord.state.ban(peer, "forged proofs", time.time())  # banned in the store, its gossip not sent
            banned_lines = lambda: sum("banned" in r.getMessage() and peer in r.getMessage()
                                       and "heartbeat" in r.getMessage() for r in caplog.records)
            await eventually(lambda: banned_lines() >= 1, 10, "a refused heartbeat of the banned peer")
            # it goes on beating for 3 intervals more (one logged refusal each), never asked back
            await eventually(lambda: banned_lines() >= 4, 10, "three more refused heartbeats", progress=banned_lines)
            assert member.rejoins == 0 and peer not in coord.state.view.members
            assert not any("told to join again" in r.getMessage() and peer in r.getMessage() for r in caplog.records)
        finally:
            await stop_all(coord, [member])
    run(body(), 60)
