"""A role's fetch keeps its store bounded (`fetch_policy` runs the store's retention), and the inference role defers
that retention until the version is queued for its engine (`retain=False`, then `retain_policies`): deleting an
old payload is not the new version's wait."""

import asyncio

import torch

from node.roles.common import KEEP_BEYOND_K, fetch_policy, fresh_model, retain_policies
from node.rl.parallel.publish import publish_model
from protocol.identity import NodeKey
from protocol.messages import RunSpec
from shardcast.publish import PublishOptions
from shardcast.server import ShardServer
from shardcast.store import Store

PEER = "12D3KooWGzh1b2VJ2c8Nk5rQb9P9s1p7pY9yq1Qe4sXvTtF3gW8E"


def test_a_fetch_retains_at_once_or_when_its_caller_says(tmp_path):
    key = NodeKey.from_seed(b"\x05" * 32)
    trainer = Store(tmp_path / "trainer")
    model = fresh_model(RunSpec(run_id="r", coordinator=PEER, environment="reverse"))
    versions = 2 * (1 + KEEP_BEYOND_K) + 1  # k = 1 (RunSpec's default below): 1 + KEEP_BEYOND_K kept
    for v in range(versions):
        with torch.no_grad():
            model.model.norm.weight.add_(0.01)  # a policy step
        publish_model(model, None, trainer, key, "r", v, None, PublishOptions(keep_last=versions))  # each whole

    async def main():
        server = ShardServer(trainer)
        port = await server.start("127.0.0.1", 0)
        spec = RunSpec(run_id="r", coordinator=PEER, environment="reverse", trainer=key.peer_id,
                       shardcast_sources=[f"http://127.0.0.1:{port}"])
        keep = spec.max_off_policy_steps + KEEP_BEYOND_K
        try:
            deferred, at_once = Store(tmp_path / "deferred"), Store(tmp_path / "at-once")
            for v in range(versions):
                await fetch_policy(spec, deferred, v, retain=False)
                await fetch_policy(spec, at_once, v)
            assert len(deferred.versions("r")) == versions  # nothing deleted while fetching
            assert at_once.versions("r") == list(range(versions - keep, versions))  # bounded as it went
            await retain_policies(spec, deferred)
            assert deferred.versions("r") == at_once.versions("r") and max(deferred.versions("r")) == versions - 1
        finally:
            await server.stop()

    asyncio.run(main())
