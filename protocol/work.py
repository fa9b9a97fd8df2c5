"""Work units: task index and sampling seed derived from (run, step, work id), never chosen.

A node cannot pick easy tasks (the coordinator mints work ids in order and the task follows from
the hash), and a validator can re-derive the seed from public facts: the work's seed and the
identity it was leased to (`holder_seed`), so a rollout is bound to the lease it was made under.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from protocol.envelope import open_envelope
from protocol.errors import MalformedWork, ProtocolError
from protocol.messages import RolloutGroup, RolloutSubmission, StoredWork


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


@dataclass(frozen=True)
class AcceptedGroup:
    """An accepted work unit opened for the roles that read it (the trainer's step, the validator's
    judging): the coordinator's facts of the unit and the rollout group its submitter signed, in the
    run's shape."""

    work_id: int
    task_index: int
    """Its derived task."""
    seed: int
    """Its sampling seed root as leased to the submitter (`holder_seed`)."""
    submitter: str
    """PeerID whose signature the group carries."""
    group: RolloutGroup


@dataclass(frozen=True)
class UnreadableUnit:
    """An accepted work unit that does not open: its envelope does not verify for the run, or the
    message is not a rollout group of the run's shape (`unit_group`)."""

    work_id: int
    submitter: str
    """PeerID whose signature the envelope carries ("?" when the signature is what failed)."""
    error: ProtocolError
    """Why, typed."""


OpenedUnit = AcceptedGroup | UnreadableUnit
"""What a role gets for each accepted work unit it reads (`CoordinatorClient.batch`, `.to_verify`)."""


def open_unit(item: StoredWork, run_id: str, group_size: int) -> OpenedUnit:
    """The unit as its readers use it. Its envelope is re-verified (signature and run; no clock window:
    a stored unit is as old as it is), never trusted because the coordinator accepted it."""
    try:
        opened = open_envelope(item.envelope, run_id, None, max_skew_s=float("inf"))
    except ProtocolError as exc:
        return UnreadableUnit(item.work_id, "?", exc)
    try:
        group = unit_group(opened.message, item.work_id, group_size)
    except MalformedWork as exc:
        return UnreadableUnit(item.work_id, opened.signer, exc)
    return AcceptedGroup(item.work_id, item.task_index, item.seed, opened.signer, group)
