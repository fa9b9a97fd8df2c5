"""A validator on another host than the trainer holds an announced version although the announcement comes
before the version's wire shards exist (it is listed beside the trainer first: `shardcast.publish.
publish_stream`): its first fetch is told the version is not there, and it asks again until it holds it
(`ValidatorNode._prefetch`, `PREFETCH_FOR_S`). Real parts: the trainer's store served over 127.0.0.1, the
validator role's own store and fetch."""

from __future__ import annotations

import asyncio
import copy

import torch

from node.model.checkpoint import state_dict_to_hf
from node.roles.common import fresh_model
from node.roles.resident_policy import ResidentPolicies
from node.roles.validator import ValidatorNode
from protocol.identity import NodeKey
from protocol.messages import PolicyAnnounce, RunSpec
from shardcast.codec import flatten
from shardcast.publish import PublishOptions, publish, publish_stream
from shardcast.server import ShardServer
from shardcast.store import Store


def test_a_validator_elsewhere_holds_a_version_announced_before_its_wire_shards(tmp_path):
    trainer_key = NodeKey.generate()
    model = fresh_model(RunSpec(run_id="x", coordinator="c", recipe={"hidden": 64}))
    v0 = state_dict_to_hf(model)
    v1 = {k: t + 1e-2 * torch.randn_like(t) if t.is_floating_point() else t for k, t in v0.items()}
    trainer = Store(tmp_path / "trainer")
    h0 = publish(trainer, trainer_key, "remote", 0, v0).manifest.manifest_hash()

    async def body():
        server = ShardServer(trainer)
        port = await server.start("127.0.0.1", 0)
        spec = RunSpec(run_id="remote", coordinator="c", environment="reverse", trainer=trainer_key.peer_id,
                       recipe={"hidden": 64}, shardcast_sources=[f"http://127.0.0.1:{port}"])
        validator = ValidatorNode(NodeKey.generate(), spec, "", tmp_path / "validator")  # a store of its own
        validator.hashes, validator.policies = {0: h0}, ResidentPolicies(copy.deepcopy(model), 0, bytes.fromhex(h0))
        loop = asyncio.get_running_loop()
        tries: list[BaseException | None] = []  # each fetch and hold the prefetch made: its error, or None
        tried = asyncio.Condition()
        real = validator._fetch_and_hold

        async def fetch_and_hold(version):
            try:
                await real(version)
                outcome = None
            except Exception as exc:  # noqa: BLE001 - recorded, then raised as before
                outcome = exc
            async with tried:
                tries.append(outcome)
                tried.notify_all()
            if outcome is not None:
                raise outcome

        validator._fetch_and_hold = fetch_and_hold

        async def announced(local):
            await validator._on_announce(PolicyAnnounce(version=1, manifest_hash=local.manifest.manifest_hash()))
            async with tried:  # its first fetch and hold, before the wire shards are listed
                await tried.wait_for(lambda: tries)

        def on_signed(local):  # on the publishing thread: the wire shards wait for the validator's first try
            asyncio.run_coroutine_threadsafe(announced(local), loop).result(60)

        tensors, payload = flatten(v1)
        try:
            await asyncio.to_thread(publish_stream, trainer, trainer_key, "remote", 1, tensors, payload,
                                    iter([len(payload)]), 0, PublishOptions(), on_signed)
            async with tried:  # the prefetch asks again and holds it
                await tried.wait_for(lambda: tries[-1] is None)
        finally:
            await server.stop()
        return validator, tries

    validator, tries = asyncio.run(asyncio.wait_for(body(), 90))
    assert "could not fetch policy v1" in str(tries[0]) and tries[-1] is None  # told it is not there, then held
    assert validator.policies.newest == 1
    got = state_dict_to_hf(validator.policies[1][0])  # the resident model switched to v1: its bits exactly
    assert sorted(got) == sorted(v1) and all(torch.equal(got[k], v1[k]) for k in v1)
