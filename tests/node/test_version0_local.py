"""Version 0 comes from the member's own checkpoint when it is exactly what the trainer published
(only the signed manifest travels), and over shardcast otherwise."""

import asyncio

import torch

from node.model.checkpoint import state_dict_to_hf
from node.roles.common import fetch_policy, fresh_model
from node.roles.version0 import LocalVersion0, has_checkpoint, local_version0
from node.rl.parallel.publish import publish_model
from protocol.identity import NodeKey
from protocol.messages import RunSpec
from protocol.model_spec import ModelSpec
from shardcast.server import ShardServer
from shardcast.store import Store

PEER = "12D3KooWGzh1b2VJ2c8Nk5rQb9P9s1p7pY9yq1Qe4sXvTtF3gW8E"


def _serve_and(store: Store, key: NodeKey, go):
    async def main():
        server = ShardServer(store)
        port = await server.start("127.0.0.1", 0)
        spec = RunSpec(run_id="r", coordinator=PEER, environment="reverse", trainer=key.peer_id,
                       shardcast_sources=[f"http://127.0.0.1:{port}"])
        try:
            return await go(spec), server.bytes_served
        finally:
            await server.stop()
    return asyncio.run(main())


def _publish(store: Store, key: NodeKey, model) -> str:
    return publish_model(model, None, store, key, "r", 0, None, None).manifest.manifest_hash()


def test_a_member_with_the_checkpoint_loads_version_0_itself_and_downloads_no_shard(tmp_path):
    key = NodeKey.from_seed(b"\x02" * 32)
    spec0 = RunSpec(run_id="r", coordinator=PEER, environment="reverse")
    announced = _publish(Store(tmp_path / "trainer"), key, fresh_model(spec0))
    member = Store(tmp_path / "member")
    state, served = _serve_and(Store(tmp_path / "trainer"), key, lambda spec: local_version0(spec, member, announced))
    assert state is not None and served == 0, "only the manifest travelled"
    want = state_dict_to_hf(fresh_model(spec0))
    assert set(state) == set(want) and all(torch.equal(state[k], want[k]) for k in want)
    assert member.manifest("r", 0).manifest.manifest_hash() == announced  # kept: the role binds proofs to it
    assert member.held_shards("r", 0) == []


def test_a_warmed_up_version_0_is_fetched_not_taken_from_the_checkpoint(tmp_path):
    key = NodeKey.from_seed(b"\x03" * 32)
    spec0 = RunSpec(run_id="r", coordinator=PEER, environment="reverse")
    warmed = fresh_model(spec0)
    with torch.no_grad():
        warmed.model.norm.weight.add_(0.5)  # what a supervised warm-up does to version 0
    announced = _publish(Store(tmp_path / "trainer"), key, warmed)
    member = Store(tmp_path / "member")

    async def go(spec):
        assert await local_version0(spec, member, announced) is None
        return await fetch_policy(spec, member, 0, announced)

    state, served = _serve_and(Store(tmp_path / "trainer"), key, go)
    assert served > 0 and torch.equal(state["model.norm.weight"], warmed.model.norm.weight)


def test_a_member_without_the_checkpoint_has_no_local_version_0(tmp_path):
    spec = RunSpec(run_id="r", coordinator=PEER, environment="reverse",
                   model=ModelSpec(source=str(tmp_path / "not-here")))
    assert not has_checkpoint(spec)
    assert asyncio.run(local_version0(spec, Store(tmp_path / "s"))) is None


def _publish_v0_v1(store: Store, key: NodeKey, v0_model) -> tuple[str, torch.nn.Module]:
    """Version 0 as given, and version 1 (norm weights moved: an RL step) published as a delta of it."""
    v0 = _publish(store, key, v0_model)
    stepped = fresh_model(RunSpec(run_id="r", coordinator=PEER, environment="reverse"))
    stepped.load_state_dict(v0_model.state_dict())
    with torch.no_grad():
        stepped.model.norm.weight.add_(0.25)
    signed = publish_model(stepped, None, store, key, "r", 1, 0, None)
    assert signed.manifest.encoding == "delta" and signed.manifest.parent == 0
    return v0, stepped


def test_a_member_that_joins_at_version_1_reads_its_parent_from_the_checkpoint_and_downloads_only_the_delta(tmp_path):
    key = NodeKey.from_seed(b"\x04" * 32)
    spec0 = RunSpec(run_id="r", coordinator=PEER, environment="reverse")
    _, stepped = _publish_v0_v1(Store(tmp_path / "trainer"), key, fresh_model(spec0))
    trainer = Store(tmp_path / "trainer")
    v0_wire, v1_wire = (trainer.manifest("r", v).manifest.wire_bytes for v in (0, 1))
    want = state_dict_to_hf(stepped)

    def joins(member: Store, local: bool):
        return _serve_and(trainer, key, lambda spec: fetch_policy(spec, member, 1, local=LocalVersion0(spec) if local else None))

    state, served = joins(Store(tmp_path / "member"), local=True)
    assert served == v1_wire, f"served {served} bytes; the delta alone is {v1_wire} (version 0: {v0_wire})"
    assert set(state) == set(want) and all(torch.equal(state[k], want[k]) for k in want)
    assert Store(tmp_path / "member").held_shards("r", 0) == []
    # the same join without the hook fetches version 0 whole first: what the hook saves
    state, served = joins(Store(tmp_path / "other"), local=False)
    assert served == v0_wire + v1_wire and all(torch.equal(state[k], want[k]) for k in want)


def test_a_checkpoint_that_is_not_the_published_version_0_is_not_taken_as_the_delta_parent(tmp_path):
    key = NodeKey.from_seed(b"\x05" * 32)
    spec0 = RunSpec(run_id="r", coordinator=PEER, environment="reverse")
    warmed = fresh_model(spec0)
    with torch.no_grad():
        warmed.model.norm.weight.add_(0.5)  # the published version 0 is not the member's checkpoint
    _, stepped = _publish_v0_v1(Store(tmp_path / "trainer"), key, warmed)
    trainer = Store(tmp_path / "trainer")
    member = Store(tmp_path / "member")
    state, served = _serve_and(trainer, key, lambda spec: fetch_policy(spec, member, 1, local=LocalVersion0(spec)))
    assert served == trainer.manifest("r", 0).manifest.wire_bytes + trainer.manifest("r", 1).manifest.wire_bytes
    want = state_dict_to_hf(stepped)
    assert all(torch.equal(state[k], want[k]) for k in want)
