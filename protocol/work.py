"""Work units: task index and sampling seed derived from (run, step, work id), never chosen.

A node cannot pick easy tasks (the coordinator mints work ids in order and the task follows from
the hash), and a validator can re-derive the seed from public facts: the work's seed and the
identity it was leased to (`holder_seed`), so a rollout is bound to the lease it was made under.
"""

from __future__ import annotations

import hashlib
import struct

from protocol.errors import MalformedWork
from protocol.messages import RolloutGroup, RolloutSubmission


def derive_work(run_id: str, step: int, work_id: int, tasks: int) -> tuple[int, int]:
    """(task index in [0, tasks), 64-bit seed) for a work unit."""
    digest = hashlib.sha256(b"primerl-node/work/v1\x00" + run_id.encode() + b"\x00" +
                            struct.pack(">qQ", step, work_id)).digest()
    seed = int.from_bytes(digest[:8], "big")
    task = int.from_bytes(digest[8:16], "big") % tasks
    return task, seed


def sampling_seed(work_seed: int, position: int) -> int:
    """Seed for the sampling decision at `position` of a rollout (validators re-derive it)."""
    digest = hashlib.sha256(struct.pack(">QQ", work_seed, position)).digest()
    return int.from_bytes(digest[:8], "big")


def holder_seed(work_seed: int, holder: str) -> int:
    """The sampling seed root of a work unit as leased to `holder`: the same task, but seeds no other
    identity's lease shares. A rollout carries the choices its seed made, so rollouts made under one
    holder's lease fail the sampling replay when another identity submits them for the same work after
    a re-grant (credit follows the work: SECURITY.md)."""
    digest = hashlib.sha256(b"primerl-node/holder/v1\x00" + struct.pack(">Q", work_seed) + holder.encode()).digest()
    return int.from_bytes(digest[:8], "big")


def unit_group(message: object, work_id: int, group_size: int) -> RolloutGroup:
    """The rollout group a work unit is, or `MalformedWork`: a `RolloutGroup` of exactly the run's
    `group_size` rollouts for `work_id`; a bare `RolloutSubmission` is a group of one, and only where
    the run's groups have one rollout. Checked at admission, by the validator and at batch assembly,
    so nothing of another shape reaches a trainer step."""
    if isinstance(message, RolloutSubmission) and group_size == 1:
        message = RolloutGroup(work_id=message.work_id, rollouts=[message])
    if not isinstance(message, RolloutGroup):
        raise MalformedWork(f"work {work_id}: a {type(message).__name__} where the run expects a rollout group "
                            f"of {group_size}")
    if message.work_id != work_id:
        raise MalformedWork(f"work {work_id}: the group answers work {message.work_id}")
    if len(message.rollouts) != group_size:
        raise MalformedWork(f"work {work_id}: a group of {len(message.rollouts)} rollouts, the run's groups have "
                            f"{group_size}")
    return message
