"""Version 0 from the member's own copy of the run's checkpoint, not again over shardcast.

The spec names version 0's source (a directory every member holds, or the seeded tiny model) and may
pin its hash; the trainer publishes it as any version. A member that can build it locally fetches
only the signed manifest (a few KB) and uses its own weights when they are exactly what was published:
the same names, dtypes and shapes, and every shard's raw hash equal to the manifest's (a trainer that
warmed the model up first publishes other weights, and then the member fetches them as usual).

Invariant: a role never serves or judges weights it did not check; here the check is the trainer's
signature on the manifest plus the raw hash of every shard, the same hashes a fetch verifies.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from node.model.checkpoint import state_dict_to_hf
from node.model.errors import ModelLoadError
from node.model.spec import resolve
from node.roles.common import fresh_model
from protocol.errors import ProtocolError
from protocol.messages import RunSpec
from shardcast.codec import matches_manifest
from shardcast.fetch import Fetcher
from shardcast.manifest import TrustedPublishers
from shardcast.store import Store

log = logging.getLogger(__name__)


def has_checkpoint(spec: RunSpec) -> bool:
    """Whether this member can build version 0 itself (the tiny model, or the spec's directory is here)."""
    try:
        resolve(spec.model.source)
    except ModelLoadError:
        return False
    return True


async def local_version0(spec: RunSpec, store: Store, expect_hash: str | None = None) -> dict[str, torch.Tensor] | None:
    """Version 0's HF-named tensors from this member's checkpoint (CPU), or None when it has none, the
    manifest cannot be had now, or the published version 0 is not its checkpoint (fetch it then)."""
    if not has_checkpoint(spec) or store.payload_path(spec.run_id, 0).exists():
        return None  # beside the trainer (one store per host) version 0 is in the store already: read it there
    t0 = time.perf_counter()
    try:
        trusted = TrustedPublishers([spec.trainer] if spec.trainer else [])
        async with Fetcher(store, list(spec.shardcast_sources), trusted) as f:
            m = await f.manifest(spec.run_id, 0)
    except ProtocolError as exc:
        log.info("version 0: no manifest yet (%s); fetching it through shardcast", exc)
        return None
    if expect_hash is not None and m.manifest_hash() != expect_hash:
        log.warning("version 0: manifest hash is not the announced one; fetching it through shardcast")
        return None
    try:
        # load_model checks the spec's pinned hash (a wrong local copy raises, it is never served)
        state = await asyncio.to_thread(lambda: state_dict_to_hf(fresh_model(spec, "cpu")))
    except ModelLoadError as exc:
        log.warning("version 0: the local checkpoint does not load (%s); fetching it through shardcast", exc)
        return None
    same = await asyncio.to_thread(matches_manifest, m.tensors, m.shards, m.shard_size, state)
    if not same:
        log.info("version 0: the published weights differ from the local checkpoint (a warm-up ran); fetching them")
        return None
    log.info("version 0 from the local checkpoint in %.1f s (manifest checked, %.1f MiB not downloaded)",
             time.perf_counter() - t0, m.wire_bytes / 2**20)
    return state
