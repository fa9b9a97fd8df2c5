"""A unit whose policy version the validator is still fetching and holding (seconds for a 10 GB version) waits for
the next round; the round judges the others at once. Before session 39 the round awaited the hold first, and at
5.2B (session 38's H200 network) its 5-7 s of rounds held every verdict back: the coordinator granted no more
leases and the inference node stood idle 17 s of 48."""

from __future__ import annotations

import asyncio
import copy

import torch

from node.model.checkpoint import state_dict_to_hf
from node.roles.common import fresh_model
from node.roles.resident_policy import ResidentPolicies
from node.roles.validator import ValidatorNode
from protocol.identity import NodeKey
from protocol.messages import RunSpec
from protocol.work import open_unit
from role_rollouts import rolled_out, stored


def test_units_of_a_version_being_held_wait_while_the_rounds_others_are_judged(tmp_path):
    spec = RunSpec(run_id="hold", coordinator="c", environment="reverse", group_size=2, recipe={"hidden": 64})
    v0 = fresh_model(spec)
    v1 = copy.deepcopy(v0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in v1.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05 * p.float().std().clamp_min(1e-3))
    m0, m1 = "cd" * 32, "ef" * 32
    key0, grants0, groups0 = rolled_out(spec, v0, m0, tmp_path / "node-v0", 2, task0=200)
    key1, grants1, groups1 = rolled_out(spec, v1, m1, tmp_path / "node-v1", 2, task0=300, version=1, first=2)
    units0 = [open_unit(item, spec.run_id, spec.group_size) for item in stored(key0, spec, grants0, groups0)]
    units1 = [open_unit(item, spec.run_id, spec.group_size) for item in stored(key1, spec, grants1, groups1)]
    state1 = {k: t.clone() for k, t in state_dict_to_hf(v1).items()}

    validator = ValidatorNode(NodeKey.generate(), spec, "", tmp_path / "validator")
    validator.hashes = {0: m0, 1: m1}
    validator.policies = ResidentPolicies(copy.deepcopy(v0), 0, bytes.fromhex(m0))

    async def body() -> None:
        fetched = asyncio.Event()

        async def fetch_and_hold() -> None:  # the fetch's seconds end when the test says; then the role's own hold
            await fetched.wait()
            await validator._hold(1, state1, bytes.fromhex(m1))

        hold = validator._holding[1] = asyncio.ensure_future(fetch_and_hold())
        verdicts = await asyncio.wait_for(validator._judge(units0 + units1), 60)  # not behind the hold
        assert [v.work_id for v in verdicts] == [0, 1] and all(v.valid for v in verdicts), verdicts
        assert not hold.done() and 1 not in validator.policies
        # the role's loop waits until the hold ends, not its whole timeout (600 s here: the wait below would fail)
        waiting = asyncio.ensure_future(validator.until_a_hold_ends(600))
        fetched.set()
        await asyncio.wait_for(waiting, 60)
        assert hold.done() and 1 in validator.policies
        del validator._holding[1]  # as `_policy`'s callback does
        verdicts = await asyncio.wait_for(validator._judge(units1), 60)
        assert [v.work_id for v in verdicts] == [2, 3] and all(v.valid for v in verdicts), verdicts

    asyncio.run(asyncio.wait_for(body(), 120))
    assert validator.rejected == 0 and validator.judged == 4
