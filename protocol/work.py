"""Work units: task index and sampling seed derived from (run, step, work id), never chosen.

A node cannot pick easy tasks (the coordinator mints work ids in order and the task follows from
the hash), and a validator can re-derive the seed from public facts.
"""

from __future__ import annotations

import hashlib
import struct


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
