"""A unit the validator cannot judge (its policy version cannot be fetched) is offered again, never
deferred forever (issue 29, attack 2): once `UNJUDGEABLE_AFTER_S` has passed while the validator
fetched other versions, it fails as unjudgeable, a borderline verdict (a strike against its submitter);
while no version can be fetched at all (the origin is down), it strikes nobody."""

from __future__ import annotations

import asyncio
import socket
import time

from node.roles import validator as validator_role
from node.roles.validator import ValidatorNode
from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.messages import RolloutGroup, RolloutSubmission, RunSpec, StoredWork
from protocol.work import open_unit


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unjudgeable_unit_fails_after_the_deadline_only_while_other_versions_can_be_fetched(tmp_path, monkeypatch):
    submitter = NodeKey.generate()
    spec = RunSpec(run_id="deadline", coordinator=NodeKey.generate().peer_id, environment="reverse",
                   trainer=NodeKey.generate().peer_id, shardcast_sources=[f"http://127.0.0.1:{closed_port()}"])
    node = ValidatorNode(NodeKey.generate(), spec, "", tmp_path)
    sub = RolloutSubmission(work_id=7, version_runs=[(5, 3)], token_ids=[4, 5, 6], logprobs=[-0.5] * 3, reward=0.0,
                            finish_reason="eos")
    item = open_unit(StoredWork(work_id=7, task_index=1, seed=2,
                                envelope=seal(submitter, spec.run_id, RolloutGroup(work_id=7, rollouts=[sub]))),
                     spec.run_id, spec.group_size)  # as the validator's client hands it over
    monkeypatch.setattr(validator_role, "UNJUDGEABLE_AFTER_S", 0.5)

    async def body() -> None:
        assert await node._judge([item]) == []  # version 5 is not fetchable: offered again later
        await asyncio.sleep(0.6)
        assert await node._judge([item]) == []  # past the deadline, but nothing could be fetched: nobody struck
        node._fetched_at = time.monotonic()  # what `_policy` records when another version arrives
        [verdict] = await node._judge([item])
        assert not verdict.valid and verdict.severity == "borderline" and verdict.reason.startswith("unjudgeable")
        assert verdict.submitter == submitter.peer_id and verdict.work_id == 7
        assert node._deferred == {}  # judged: no longer waiting
    asyncio.run(asyncio.wait_for(body(), 60))
