"""What a finished `primerl-node sim` left on disk, read back for tests: the tensors of a version the
trainer published, and the units a trainer step trained on, opened as the trainer's client opens them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from protocol import pipeline
from protocol.coordinator import Coordinator
from protocol.messages import RunSpec
from protocol.work import OpenedUnit, open_unit


def published(out: Path, spec: RunSpec, version: int) -> dict[str, torch.Tensor]:
    """Version `version` as the trainer's shardcast store holds it (HF names)."""
    from node.sim_network import store_of
    from shardcast.fetch import read_held
    from shardcast.manifest import TrustedPublishers
    from shardcast.store import Store

    store = Store(store_of(out, "trainer"))
    assert store.manifest(spec.run_id, version) is not None, f"v{version} not in the trainer's store"
    got = read_held(store, TrustedPublishers([spec.trainer]), spec.run_id, version)  # its payload may be dropped
    return {k: t.clone() for k, t in got.tensors().items()}


def step_units(out: Path, spec: RunSpec, step: int) -> list[OpenedUnit]:
    """The units the trainer logged for `step`, read back from the coordinator's store."""
    rows = [json.loads(x) for x in (out / "trainer" / "metrics.jsonl").read_text().splitlines()]
    work_ids = next(r["work_ids"] for r in rows if r["step"] == step)
    state = Coordinator(out / "coordinator", spec)
    try:
        return [open_unit(item, spec.run_id, spec.group_size) for item in pipeline.stored(state, work_ids)]
    finally:
        state.close()
