"""Optimizer state between the sharded world and one process's layout (checkpoints, resume).

Invariant: `load_optimizer_state(full_optimizer_state(t))` restores every rank's shard exactly, and
the full layout is `Trainer`'s (one AdamW state per one-process parameter name), so a checkpoint
written by the distributed trainer is an ordinary `Trainer` checkpoint and either can resume it.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from node.rl.parallel.apply import is_expert_param
from node.rl.parallel.trainer import DistributedTrainer, full_tensor

MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW's per-parameter tensors; its `step` is a scalar."""


def full_optimizer_state(trainer: DistributedTrainer) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's AdamW state, whole (collective: every rank calls, every rank gets it).
    A parameter with no state yet (no step taken) is gathered as zeros, so that every rank runs
    the same collectives whatever its own state holds; `step` 0 marks it."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in trainer.model.named_parameters():
        state = trainer.optimizer.state.get(p, {})
        entry = {k: full_tensor(trainer.groups, name, state[k] if k in state else torch.zeros_like(p))
                 for k in MOMENTS}
        step = state.get("step", torch.zeros(()))
        entry["step"] = step.detach().clone().float().cpu() if torch.is_tensor(step) else torch.tensor(float(step))
        out[name] = entry
    return out


def local_part(trainer: DistributedTrainer, name: str, p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a whole parameter-shaped tensor: its experts (EP), then its FSDP shard."""
    g = trainer.groups
    if is_expert_param(name) and g.dims.ep > 1:
        per = full.shape[0] // g.dims.ep
        full = full[g.ep_rank * per:(g.ep_rank + 1) * per]
    full = full.to(device=p.device, dtype=p.dtype)
    if isinstance(p, DTensor):  # every rank holds `full`: slice locally, no communication
        return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
    return full.clone()


def load_optimizer_state(trainer: DistributedTrainer, state: dict[str, dict[str, torch.Tensor]]) -> None:
    """Set each parameter's AdamW state from the whole state (every rank holds it); parameters
    whose `step` is 0 keep no state, as AdamW before its first step."""
    for name, p in trainer.model.named_parameters():
        entry = state.get(name)
        if entry is None or float(entry["step"]) == 0:
            continue
        trainer.optimizer.state[p] = {"step": entry["step"].detach().clone().float().cpu(),
                                      **{k: local_part(trainer, name, p, entry[k]) for k in MOMENTS}}
