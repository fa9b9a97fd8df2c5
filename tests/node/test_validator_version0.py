"""A validator whose first version is a later one still checks a version 0 it fetches afterwards against
the run's pinned weights hash (`ValidatorNode._hold`): the published version 0 joins the resident model,
weights of another model are refused with the typed `WeightsHashMismatch`."""

from __future__ import annotations

import asyncio

import pytest
import torch

from node.model.checkpoint import state_dict_to_hf
from node.model.errors import WeightsHashMismatch
from node.model.spec import weights_hash
from node.roles.common import fresh_model
from node.roles.validator import ValidatorNode
from protocol.identity import NodeKey
from protocol.messages import RunSpec


def test_a_version_0_fetched_after_a_later_version_is_checked_against_the_pin(tmp_path):
    spec = RunSpec(run_id="late-v0", coordinator=NodeKey.generate().peer_id, environment="reverse")
    v0 = fresh_model(spec)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"weights_hash": weights_hash(v0)})})
    state0 = {k: t.clone() for k, t in state_dict_to_hf(v0).items()}
    state1 = {k: t + 0.01 for k, t in state0.items()}
    node = ValidatorNode(NodeKey.generate(), spec, "", tmp_path)
    asyncio.run(node._hold(1, state1, b"\1" * 32))
    with pytest.raises(WeightsHashMismatch):
        asyncio.run(node._hold(0, state1, b"\0" * 32))  # version 1's weights offered as version 0
    assert sorted(node.policies) == [1]
    asyncio.run(node._hold(0, state0, b"\0" * 32))
    model, manifest_hash = node.policies[0]
    assert manifest_hash == b"\0" * 32
    assert all(torch.equal(model.state_dict()[k], t) for k, t in v0.state_dict().items())


def test_an_announced_version_is_held_before_any_unit_needs_it_once_whoever_asks(tmp_path):
    """`_on_announce` starts the fetch and hold of the newest version at once (off the path from a step to
    its verdicts); a judging round asking for the same version meanwhile waits for that one hold."""
    import asyncio

    from node.rl.parallel.publish import publish_model
    from protocol.messages import PolicyAnnounce
    from shardcast.store import Store

    key = NodeKey.from_seed(b"\x07" * 32)
    spec = RunSpec(run_id="r", coordinator=NodeKey.generate().peer_id, environment="reverse", trainer=key.peer_id,
                   shardcast_sources=["http://127.0.0.1:9"])  # never asked: the validator's store holds both
    node = ValidatorNode(NodeKey.generate(), spec, "", tmp_path)
    model = fresh_model(spec)
    hashes = {0: publish_model(model, None, node.store, key, "r", 0, None, None).manifest.manifest_hash()}
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)
    hashes[1] = publish_model(model, None, node.store, key, "r", 1, 0, None).manifest.manifest_hash()
    holds = []
    real_hold = node._hold
    node._hold = lambda v, *a, **kw: (holds.append(v), real_hold(v, *a, **kw))[1]

    async def main():
        for v in (0, 1):
            await node._on_announce(PolicyAnnounce(version=v, manifest_hash=hashes[v]))
        await asyncio.wait_for(node._policy(1), 60)  # a round asking while the announced hold runs
        deadline = asyncio.get_running_loop().time() + 60
        while node._holding and asyncio.get_running_loop().time() < deadline:  # the prefetches end by themselves
            await asyncio.sleep(0.05)

    asyncio.run(main())
    assert sorted(node.policies) == [0, 1] and sorted(holds) == [0, 1], holds  # each held once, no unit asked
    held, _ = node.policies[1]
    assert torch.equal(held.model.norm.weight, model.model.norm.weight)


def test_a_version_announced_while_a_round_recomputes_changes_no_weight_under_it(tmp_path):
    """Holding changes the resident model's weights (node/roles/model_turns.py): a hold waits for a round that
    switches versions (a writer's turn); beside a round that judges the newest version (a reader's) it prepares
    the next version's step, and reads it in only once that round is done."""
    import asyncio

    from node.rl.parallel.publish import publish_model
    from protocol.messages import PolicyAnnounce

    key = NodeKey.from_seed(b"\x08" * 32)
    spec = RunSpec(run_id="r", coordinator=NodeKey.generate().peer_id, environment="reverse", trainer=key.peer_id,
                   shardcast_sources=["http://127.0.0.1:9"])
    node = ValidatorNode(NodeKey.generate(), spec, "", tmp_path)
    model = fresh_model(spec)
    h0 = publish_model(model, None, node.store, key, "r", 0, None, None).manifest.manifest_hash()
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)
    h1 = publish_model(model, None, node.store, key, "r", 1, 0, None).manifest.manifest_hash()
    holds, prepared = [], []
    real_hold = node._hold
    node._hold = lambda v, *a, **kw: (holds.append(v), real_hold(v, *a, **kw))[1]

    async def main():
        assert not await node._turns.enter(lambda: False)  # a round switching versions
        await node._on_announce(PolicyAnnounce(version=0, manifest_hash=h0))
        await node._turns.until(lambda: node._turns.writers_waiting == 1, 60)  # v0's hold, fetched, waits
        assert node.policies is None, "a version was held under a round's recomputation"
        await node._turns.leave(reader=False)
        await asyncio.wait_for(node._policy(0), 60)
        assert holds == [0] and sorted(node.policies) == [0]

        policies = node.policies
        real_prepare = policies.prepare
        policies.prepare = lambda *a: (r := real_prepare(*a), prepared.append(policies.newest))[0]
        assert await node._turns.enter(lambda: policies.at_newest)  # a round judging v0, the newest
        await node._on_announce(PolicyAnnounce(version=1, manifest_hash=h1))
        # v1 prepared beside the round (before it asks to read in), its read-in waiting for the round
        await node._turns.until(lambda: node._turns.writers_waiting == 1, 60)
        assert prepared == [0] and policies.newest == 0 and policies.active == 0, "read in under the round"
        await node._turns.leave(reader=True)
        await asyncio.wait_for(node._policy(1), 60)

    asyncio.run(main())
    assert holds == [0, 1] and sorted(node.policies) == [0, 1] and node.policies.newest == 1
    held, _ = node.policies[1]
    assert torch.equal(held.model.norm.weight, model.model.norm.weight)
