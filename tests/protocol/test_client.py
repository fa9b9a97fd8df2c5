"""The coordinator client over real libp2p hosts: typed operations, reply types checked, re-join
after `NotMember`, refusals passed through as answers."""

from __future__ import annotations

import asyncio

import pytest
from protocol_testnet import make_spec, run, start_coordinator, start_member, stop_all

from protocol.client import ONCE, CoordinatorClient, Retry
from protocol.errors import NotMember, StaleRollout, UnexpectedReply
from protocol.identity import NodeKey
from protocol.messages import LeaseBatchRequest, Ok, RolloutGroup, RolloutSubmission
from protocol.work import AcceptedGroup


def group(work_id: int, version: int) -> RolloutGroup:
    sub = RolloutSubmission(work_id=work_id, version_runs=[(version, 3)], token_ids=[4, 5, 6], logprobs=[-1.0] * 3,
                            reward=1.0, finish_reason="eos")
    return RolloutGroup(work_id=work_id, rollouts=[sub])


def test_client_leases_submits_and_a_trainer_gets_the_batch_and_publishes(tmp_path):
    async def body():
        ck = NodeKey.generate()
        spec = make_spec(ck, batch_groups=2)
        coord = await start_coordinator(tmp_path, ck, spec, policy_version=0)
        coord.selector = lambda work_id: False  # no verdicts needed here (tests/protocol/test_pipeline.py)
        coord.state.probation_units = 0  # nor probation (tests/protocol/test_probation.py)
        coord.lease_policy = None  # nor a newcomer's budget (a quarter of this pool of 3: tests/protocol/test_lease_policy.py)
        boot = coord.host.addrs[0]
        worker, trainer = await start_member(spec, boot), await start_member(spec, boot, role="trainer")
        try:
            inference = CoordinatorClient(worker, boot)
            grants = await inference.lease(2)
            assert len(grants) == 2 and all(g.holder == worker.key.peer_id for g in grants)
            for g in grants:
                assert (await inference.submit(group(g.work_id, 0))).accepted
            coordinator = CoordinatorClient(trainer, boot)
            batch = await coordinator.batch(1, 2)  # opened: typed groups, their signer re-checked
            assert sorted(i.work_id for i in batch) == sorted(g.work_id for g in grants)
            assert all(isinstance(i, AcceptedGroup) and i.submitter == worker.key.peer_id
                       and i.group == group(i.work_id, 0) for i in batch)
            await coordinator.announce(1, "cd" * 32)
            assert coord.state.ledger.current_version == 1
            # A refusal is an answer: raised at once, typed (not retried as an outage).
            more = await inference.lease(1, holds_version=1)
            with pytest.raises(StaleRollout):
                await asyncio.wait_for(inference.submit(group(more[0].work_id, 2)), 10)
            assert inference.status().policy_version >= 0
        finally:
            await stop_all(coord, [worker, trainer])
    run(body())


def test_a_reply_of_the_wrong_type_is_a_typed_error_and_not_retried(tmp_path):
    async def body():
        ck = NodeKey.generate()
        spec = make_spec(ck)
        coord = await start_coordinator(tmp_path, ck, spec, policy_version=0)
        member = await start_member(spec, coord.host.addrs[0])
        calls = []

        async def wrong(opened) -> Ok:  # a buggy coordinator answers a lease request with Ok
            calls.append(opened.message)
            return Ok()
        coord.net.serve(LeaseBatchRequest, wrong)
        try:
            with pytest.raises(UnexpectedReply, match="expected LeaseGrants, got Ok"):
                await CoordinatorClient(member, coord.host.addrs[0], retry=Retry(tries=5)).lease(1)
            assert len(calls) == 1
        finally:
            await stop_all(coord, [member])
    run(body())


def test_a_member_the_coordinator_forgot_joins_again_and_its_request_succeeds(tmp_path):
    async def body():
        ck = NodeKey.generate()
        spec = make_spec(ck, batch_groups=4)
        coord = await start_coordinator(tmp_path, ck, spec, policy_version=0)
        boot = coord.host.addrs[0]
        member = await start_member(spec, boot)
        try:
            coord.state.leave(member.key.peer_id, 0.0)  # as after a sweep: no longer a member
            with pytest.raises(NotMember):
                await CoordinatorClient(member, boot, retry=ONCE).lease(1)
            grants = await CoordinatorClient(member, boot).lease(1)  # re-joins, then leases
            assert len(grants) == 1 and member.key.peer_id in coord.state.view.members
        finally:
            await stop_all(coord, [member])
    run(body())


def test_a_coordinator_that_fails_to_answer_is_retried_not_fatal(tmp_path):
    # the walk-through: a validator asked while the coordinator shut down got "InternalError:
    # ProgrammingError" (a request served after its state closed) and exited 2
    from protocol.errors import Refused
    from protocol.messages import LeaseGrants

    async def body():
        ck = NodeKey.generate()
        spec = make_spec(ck)
        coord = await start_coordinator(tmp_path, ck, spec, policy_version=0)
        member = await start_member(spec, coord.host.addrs[0])
        calls = []

        async def failing_then_fine(opened) -> LeaseGrants:
            calls.append(opened.message)
            if len(calls) < 3:
                raise RuntimeError("the handler broke")  # answered as Refusal(InternalError)
            return LeaseGrants(grants=[])
        coord.net.serve(LeaseBatchRequest, failing_then_fine)
        try:
            fast = Retry(tries=5, first_delay_s=0.05, max_delay_s=0.1)
            assert await CoordinatorClient(member, coord.host.addrs[0], retry=fast).lease(1) == []
            assert len(calls) == 3
            calls.clear()
            coord.net.serve(LeaseBatchRequest, failing_then_fine)
            with pytest.raises(Refused, match="InternalError"):  # out of tries: the error, typed
                await CoordinatorClient(member, coord.host.addrs[0], retry=Retry(tries=2, first_delay_s=0.05)).lease(1)
            assert len(calls) == 2
        finally:
            await stop_all(coord, [member])
    run(body())


def test_a_held_lease_request_is_answered_when_a_newer_version_leaves_its_node_behind(tmp_path):
    """A lease request held for room (the pool is out) is answered, empty, as soon as a version newer than
    the one its node holds is announced: the node is fetching that version and asks again once it holds it.
    Held to the end instead, it kept a node that had just loaded the version idle for 1-3 s (session 13)."""
    async def body():
        ck = NodeKey.generate()
        spec = make_spec(ck, batch_groups=2)  # k = 1: a pool of 3 units
        coord = await start_coordinator(tmp_path, ck, spec, policy_version=0)
        coord.lease_policy = None
        boot = coord.host.addrs[0]
        worker, trainer = await start_member(spec, boot), await start_member(spec, boot, role="trainer")
        try:
            inference = CoordinatorClient(worker, boot, retry=Retry(tries=1))
            leased = [g for _ in range(4) for g in await inference.lease(3, holds_version=0)]
            assert leased and await inference.lease(1, holds_version=0) == []  # no room left for this node
            coord.hold_s = 60.0  # longer than the client's request timeout: an answer must come from the version
            held = asyncio.ensure_future(inference.lease(1, holds_version=0))
            await CoordinatorClient(trainer, boot).announce(1, "cd" * 32)
            assert await asyncio.wait_for(held, 8) == []
        finally:
            await stop_all(coord, [worker, trainer])
    run(body())


def test_a_lone_inference_node_may_hold_the_whole_pool_and_half_of_it_beside_another(tmp_path):
    """`peer_lease_cap`: half the pool per peer, so a greedy peer cannot starve the others; the whole pool while no
    other inference node is alive (session 22's one-H200 network: half the pool held its one node to 192 sequences
    in flight of an engine with 512 slots)."""
    async def body():
        ck = NodeKey.generate()
        spec = make_spec(ck, batch_groups=16, heartbeat_interval_s=5.0)  # k = 1: a pool of 24 units
        coord = await start_coordinator(tmp_path, ck, spec, policy_version=0)
        coord.lease_policy = None  # no newcomer's budget: the cap alone
        boot = coord.host.addrs[0]
        first = await start_member(spec, boot)
        second = None
        try:
            alone = CoordinatorClient(first, boot, retry=Retry(tries=1))
            assert len(await alone.lease(30, holds_version=0)) == 24
            assert await alone.lease(1, holds_version=0) == []  # the pool is out
            second = await start_member(spec, boot)
            other = CoordinatorClient(second, boot, retry=Retry(tries=1))
            assert await other.lease(1, holds_version=0) == [], "the pool is out until the lone node's come back"
        finally:
            await stop_all(coord, [m for m in (first, second) if m is not None])
    run(body())


def test_beside_another_inference_node_a_peer_holds_at_most_half_the_pool(tmp_path):
    async def body():
        ck = NodeKey.generate()
        spec = make_spec(ck, batch_groups=16, heartbeat_interval_s=5.0)
        coord = await start_coordinator(tmp_path, ck, spec, policy_version=0)
        coord.lease_policy = None
        boot = coord.host.addrs[0]
        first, second = await start_member(spec, boot), await start_member(spec, boot)
        try:
            greedy = CoordinatorClient(first, boot, retry=Retry(tries=1))
            assert len(await greedy.lease(30, holds_version=0)) == 12
            assert len(await CoordinatorClient(second, boot, retry=Retry(tries=1)).lease(30, holds_version=0)) == 12
        finally:
            await stop_all(coord, [first, second])
    run(body())
