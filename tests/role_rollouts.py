"""An inference role's honest work, made in-process for tests that judge it: the role's own rollout code
(`InferenceNode._roll_out`) over a CPU `Engine` serving version 0, its groups signed as the coordinator
stores them."""

from __future__ import annotations

import time
from pathlib import Path

from node.engine import Engine
from node.roles.inference import InferenceNode
from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.messages import LeaseGrant, RolloutGroup, RunSpec, StoredWork


def rolled_out(spec: RunSpec, model, manifest: str, workdir: Path, works: int, task0: int = 100,
               seed=lambda w: 7 * w + 1, version: int = 0,
               first: int = 0) -> tuple[NodeKey, list[LeaseGrant], list[RolloutGroup]]:
    """(the node's key, its grants, the groups it rolled out for them) of `works` leases (work ids from `first`) on
    `version`, which `model` serves."""
    key = NodeKey.generate()
    node = InferenceNode(key, spec, "", workdir)
    node.engine = Engine(model, max_batch=8, eos_id=node.tok.eos_id, decode=node.tok.decode, capture_hidden=True,
                         version=version)
    node.hashes, node._newest_loaded = {version: manifest}, version
    grants = [LeaseGrant(work_id=w, holder=key.peer_id, policy_version=version, task_index=task0 + w, seed=seed(w),
                         deadline=time.time() + 60) for w in range(first, first + works)]
    return key, grants, node._roll_out(grants)


def stored(key: NodeKey, spec: RunSpec, grants: list[LeaseGrant], groups: list[RolloutGroup]) -> list[StoredWork]:
    """The groups as the coordinator stores them (signed by their node)."""
    return [StoredWork(work_id=g.work_id, task_index=grant.task_index, seed=grant.seed, envelope=seal(key, spec.run_id, g))
            for grant, g in zip(grants, groups)]
