"""`parallelize`: expert parallelism, then context parallelism, then FSDP2, applied to a built model.

Order matters: EP first (it replaces each MoE block's experts by this rank's slice), then FSDP
wraps the experts over the ranks that hold the same slice and every decoder layer over all ranks,
as torchtitan's `apply_fsdp` does for MoE models. FSDP reduces gradients by SUM (divide factor 1)
because `DistributedTrainer` already divides the loss by the global token count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard

from node.model.moe import MoEBlock
from node.model.qwen3_moe import CausalLM
from node.rl.parallel.context import shard_context
from node.rl.parallel.dims import ParallelGroups
from node.rl.parallel.expert import shard_experts


def parallelize(model: CausalLM, groups: ParallelGroups) -> CausalLM:
    dims = groups.dims
    for layer in model.model.layers:
        if dims.ep > 1 and isinstance(layer.mlp, MoEBlock):
            shard_experts(layer.mlp, groups.ep_rank, dims.ep, groups.ep_group)
        if dims.cp > 1:
            shard_context(layer.self_attn, groups.cp_group)
    if dims.fsdp:
        for layer in model.model.layers:
            if isinstance(layer.mlp, MoEBlock):
                fully_shard(layer.mlp.experts, mesh=groups.expert_mesh)
            fully_shard(layer, mesh=groups.world_mesh)
        fully_shard(model, mesh=groups.world_mesh)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    model.parallel_groups = groups
    return model


def is_expert_param(name: str) -> bool:
    return ".mlp.experts." in name


def sync_gradients(model: CausalLM, groups: ParallelGroups) -> None:
    """Without FSDP: sum replicated parameters' gradients over the ranks that replicate them."""
    if groups.dims.fsdp:
        return
    for name, p in model.named_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        mesh = groups.expert_mesh if is_expert_param(name) and groups.dims.ep > 1 else groups.world_mesh
        dist.all_reduce(p.grad, group=mesh.get_group())
