"""`parallelize`: expert parallelism, then context parallelism, then activation checkpointing,
then FSDP2, applied to a built model (on the meta device, or real).

Order matters: EP first (it replaces each MoE block's experts by this rank's slice), then FSDP
wraps the experts over the ranks that hold the same slice and every decoder layer over all ranks,
as torchtitan's `apply_fsdp` does for MoE models. FSDP reduces gradients by SUM (divide factor 1)
because `DistributedTrainer` already divides the loss by the global token count. With `bf16`
the parameters stay fp32 (the master copy the optimizer updates, and its fp32 states) and FSDP
all-gathers them as bf16 for the forward and backward; gradients are reduce-scattered in fp32.

Built on the meta device, the model holds nothing until `materialize`: each rank then allocates
only its shards (`state.scatter_weights` fills them from rank 0, `load.read_own_shards` from the checkpoint files, or `init_local` draws them).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from node.model.moe import MoEBlock
from node.model.qwen3_moe import CausalLM
from node.rl.parallel.context import shard_context
from node.rl.parallel.dims import ParallelGroups
from node.distributed.experts import shard_experts


def _checkpointed(forward, *args):
    return checkpoint(forward, *args, use_reentrant=False)


def checkpoint_layer(layer) -> None:
    """Recompute `layer`'s activations in the backward instead of keeping them (set on the instance)."""
    layer.forward = functools.partial(_checkpointed, layer.forward)


def parallelize(model: CausalLM, groups: ParallelGroups) -> CausalLM:
    dims = groups.dims
    dims.check_model(model.config)
    for layer in model.model.layers:
        if dims.ep > 1 and isinstance(layer.mlp, MoEBlock):
            shard_experts(layer.mlp, groups.ep_rank, dims.ep, groups.ep_group)
        if dims.cp > 1:
            shard_context(layer.self_attn, groups.cp_group)
        if dims.activation_checkpointing:
            # on the instance, inside FSDP's hooks: the recompute runs while the layer is unsharded
            checkpoint_layer(layer)
    if dims.fsdp:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dims.mixed_precision(groups.world_mesh.device_type) \
            else MixedPrecisionPolicy()
        for layer in model.model.layers:
            if isinstance(layer.mlp, MoEBlock):
                fully_shard(layer.mlp.experts, mesh=groups.expert_mesh, mp_policy=mp)
            fully_shard(layer, mesh=groups.world_mesh, mp_policy=mp)
        fully_shard(model, mesh=groups.world_mesh, mp_policy=mp)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    model.parallel_groups = groups
    return model


def materialize(model: CausalLM, device: str | torch.device) -> CausalLM:
    """A model parallelized on the meta device gets storage for this rank's shards only
    (uninitialised: fill them with `state.scatter_weights`, `load.read_own_shards` or `init_local`)."""
    model.to_empty(device=device)
    return model


def init_local(model: CausalLM, seed: int, std: float = 0.02) -> None:
    """Draw this rank's shards directly (norms 1, the rest N(0, std)), seeded per rank: for
    benchmarks and fresh runs too large for one process to build whole."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed * 7919 + dist.get_rank())
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if name.endswith("norm.weight"):
                local.fill_(1.0)
            else:
                local.normal_(0.0, std, generator=g)


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
