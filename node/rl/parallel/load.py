"""Each trainer rank reads its own shards of an HF-layout checkpoint, and nothing else.

A parameter of the parallelized model is this rank's experts (EP: a range of the stacked expert
dimension) and, under FSDP2, its `Shard(0)` rows of those: one contiguous range of dimension 0 of
the one-process tensor. `read_own_shards` reads exactly that range from the safetensors files
(`get_slice`: only those rows' bytes are touched), per expert for stacked experts, straight into
the rank's local tensor in its dtype. No rank, rank 0 included, ever holds a whole parameter of the
model beyond one expert's projection, so start-up memory per rank is its shards plus one tensor.

Rank 0 checks the checkpoint against the run's pin first (`node.model.fill.checkpoint_digest`).
"""

from __future__ import annotations

import re

import torch
from torch.distributed.tensor import DTensor

from node.model.config import ModelConfig
from node.model.fill import check_against, checkpoint_shapes, meta_model
from node.model.shards import CheckpointShards
from node.rl.parallel.apply import is_expert_param
from node.rl.parallel.dims import ParallelGroups

_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def own_rows(groups: ParallelGroups, name: str, p: torch.Tensor) -> tuple[int, int]:
    """[start, stop) of dimension 0 of the one-process tensor that this rank's part of `p` holds."""
    start, length = 0, p.shape[0]
    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        if any(o for o in offset[1:]) or tuple(local_shape[1:]) != tuple(p.shape[1:]):
            raise ValueError(f"{name}: sharded along another dimension than 0 ({p.placements})")
        start, length = offset[0], local_shape[0]
    if is_expert_param(name) and groups.dims.ep > 1:
        start += groups.ep_rank * p.shape[0]  # a DTensor's shape is the EP slice's: every rank's is equal
    return start, start + length


@torch.no_grad()
def read_own_shards(model: torch.nn.Module, groups: ParallelGroups, shards: CheckpointShards) -> None:
    """Fill every parameter's local part (allocated by `apply.materialize`) from `shards`. No communication."""
    cfg: ModelConfig = model.config
    check_against(shards, checkpoint_shapes(meta_model(cfg, torch.float32)), cfg.tie_word_embeddings)
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        start, stop = own_rows(groups, name, p)
        if local.shape[0] != stop - start:
            raise ValueError(f"{name}: local rows {local.shape[0]} but the range is [{start}, {stop})")
        m = _STACKED.match(name)
        if m is None:
            if stop > start:
                local.copy_(shards.rows(name, start, stop, local.dtype))
            continue
        prefix, kind = m.groups()
        for i, e in enumerate(range(start, stop)):
            if kind == "down_proj":
                local[i].copy_(shards.value(f"{prefix}.{e}.down_proj.weight", local.dtype))
            else:
                inter = local.shape[1] // 2
                local[i, :inter].copy_(shards.value(f"{prefix}.{e}.gate_proj.weight", local.dtype))
                local[i, inter:].copy_(shards.value(f"{prefix}.{e}.up_proj.weight", local.dtype))
