"""Versions as a member fetches them from a trainer's store over a real shardcast server on 127.0.0.1
(`node.roles.common.fetch_policy`): a delta comes with its changed bytes (`ChangedBytes`), and `whole` gives the same
version without them (what reading it whole takes)."""

from __future__ import annotations

import asyncio

from node.model.served_form import ServedForm
from node.roles.common import fetch_policy
from protocol.identity import NodeKey
from protocol.messages import RunSpec
from protocol.model_spec import ModelSpec
from shardcast.server import ShardServer
from shardcast.store import Store

COORDINATOR = "12D3KooWGzh1b2VJ2c8Nk5rQb9P9s1p7pY9yq1Qe4sXvTtF3gW8E"


def fetch_all(trainer: Store, member: Store, key: NodeKey, fp8: str, versions: list[int],
              changes_of=lambda v: None) -> dict:  # noqa: ANN001 (version -> the version a member holds, or None)
    """Each of `versions` of run "r" (published by `key` into `trainer`), fetched into `member` (the trainer's own
    store: a role on the trainer's host), each with its bytes against `changes_of(v)` where given."""
    async def main():
        server = ShardServer(trainer)
        port = await server.start("127.0.0.1", 0)
        spec = RunSpec(run_id="r", coordinator=COORDINATOR, environment="reverse", trainer=key.peer_id,
                       shardcast_sources=[f"http://127.0.0.1:{port}"], model=ModelSpec(fp8=fp8))
        try:
            return {v: await fetch_policy(spec, member, v, changes_of=changes_of(v)) for v in versions}
        finally:
            await server.stop()
    return asyncio.run(main())


def whole(state):
    """The same version without its delta's changes: what a copy of the whole version loads."""
    if isinstance(state, ServedForm):
        return ServedForm(dict(state.tensors), state.dtype)
    return dict(state)
