"""Whole tensors into shards and back, one tensor at a time (never the whole model on a rank).

`scatter_weights` / `scatter_optimizer_state`: rank 0 holds a one-process `Trainer` (warmed up, or
loaded from a `Trainer` checkpoint); each tensor is broadcast whole, every rank keeps its part
(its experts, then its FSDP shard) and drops the rest before the next tensor: the peak is one
tensor, not the model. `gather_tensors`: the reverse, one tensor at a time, for publication and
the tests (`full_tensor`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from node.rl.parallel.apply import is_expert_param
from node.rl.parallel.dims import ParallelGroups

MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW's per-parameter tensors; its `step` is a scalar."""


def global_shape(groups: ParallelGroups, name: str, p: torch.Tensor) -> torch.Size:
    """The one-process shape of a (possibly sharded, possibly expert-sliced) parameter."""
    shape = p.shape  # a DTensor's shape is its global shape on its mesh
    if is_expert_param(name) and groups.dims.ep > 1:
        shape = torch.Size((shape[0] * groups.dims.ep, *shape[1:]))
    return shape


def local_part(groups: ParallelGroups, name: str, p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a whole parameter-shaped tensor, shaped like `p` (a DTensor for a
    sharded parameter): its experts (EP), then its FSDP shard. No communication."""
    if is_expert_param(name) and groups.dims.ep > 1:
        per = full.shape[0] // groups.dims.ep
        full = full[groups.ep_rank * per:(groups.ep_rank + 1) * per]
    full = full.to(device=p.device, dtype=p.dtype)
    if isinstance(p, DTensor):
        return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
    return full.clone()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a plain tensor as it is)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _broadcast_whole(groups: ParallelGroups, name: str, p: torch.Tensor, whole: torch.Tensor | None) -> torch.Tensor:
    """Rank 0's `whole` (None elsewhere) on every rank, on p's device (collective)."""
    if dist.get_rank() == 0:
        buf = whole.detach().to(device=p.device, dtype=p.dtype).contiguous()
    else:
        buf = torch.empty(global_shape(groups, name, p), device=p.device, dtype=p.dtype)
    dist.broadcast(buf, src=0)
    return buf


def scatter_weights(model: torch.nn.Module, groups: ParallelGroups, source: dict[str, torch.Tensor] | None) -> None:
    """Fill every rank's shards from rank 0's whole parameters `source` (name -> tensor in the
    one-process layout; None on other ranks). Collective."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            whole = _broadcast_whole(groups, name, p, None if source is None else source[name])
            local_tensor(p).copy_(local_tensor(local_part(groups, name, p, whole)))
            del whole


def scatter_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: ParallelGroups,
                            source: dict[str, dict[str, torch.Tensor]] | None) -> None:
    """Set each parameter's AdamW state from rank 0's one-process state `source` (name -> {exp_avg,
    exp_avg_sq, step}; None on other ranks). Parameters whose step is 0 (or absent) keep no
    state, as AdamW before its first step. Collective."""
    for name, p in model.named_parameters():
        entry = (source or {}).get(name, {})
        step = torch.tensor([float(entry["step"]) if "step" in entry else 0.0], device=p.device)
        dist.broadcast(step, src=0)
        if float(step) == 0:
            continue
        state = {"step": step.reshape(()).cpu()}
        for k in MOMENTS:
            whole = _broadcast_whole(groups, name, p, entry.get(k) if dist.get_rank() == 0 else None)
            state[k] = local_part(groups, name, p, whole)
        optimizer.state[p] = state


def full_tensor(groups: ParallelGroups, name: str, t: torch.Tensor) -> torch.Tensor:
    """A parameter-shaped tensor (the parameter, its gradient, an optimizer moment) whole, in
    one-process layout, on every rank: FSDP shards gathered, then EP slices (collective)."""
    t = t.full_tensor() if isinstance(t, DTensor) else t
    if is_expert_param(name) and groups.dims.ep > 1:
        parts = [torch.empty_like(t) for _ in range(groups.dims.ep)]
        dist.all_gather(parts, t.contiguous(), group=groups.ep_group)
        t = torch.cat(parts, dim=0)
    return t.detach()


def gather_tensors(model: torch.nn.Module, groups: ParallelGroups | None,
                   get: Callable[[torch.Tensor], torch.Tensor] = lambda p: p.detach()) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for every parameter in order, one at a time (collective when
    `groups` is given: every rank must iterate to the end; one process: no communication)."""
    for name, p in model.named_parameters():
        t = get(p)
        yield name, (t if groups is None else full_tensor(groups, name, t))
