"""Expert parallelism: each of `ep` ranks keeps num_experts / ep experts; token-slots travel to the
rank that owns their expert through an all-to-all and come back through another.

Applied from outside: `MoEBlock.dispatch`/`combine` are replaced on the instance and
`MoEBlock.experts` becomes this rank's slice, so `MoEBlock.forward` runs unchanged. Routing stays
replicated (every rank routes its own tokens over all experts). The all-to-all is
torch.distributed's `all_to_all_single` (NCCL on GPUs, gloo on CPU) with autograd, so expert
gradients sum contributions from every rank's tokens. DeepEP is not wired in: its PyPI copies do not
build without Hopper + NVSHMEM, so it could not be tested here; `_all_to_all` is the one place a
DeepEP dispatch/combine pair would go.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from node.model.moe import GroupedExperts, MoEBlock, Routing, expert_counts
from node.distributed.world import LayoutError


@dataclass
class _Dispatched:
    """What combine needs to undo dispatch."""

    order: torch.Tensor  # local sort of token-slots by global expert id
    send_splits: list[int]  # rows sent to each EP rank
    recv_splits: list[int]  # rows received from each EP rank
    regroup: torch.Tensor  # received rows (by source, then expert) -> rows grouped by local expert


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    return dist_fn.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)


def _dispatch(block: MoEBlock, x: torch.Tensor, routing: Routing):
    ep, local = block.ep_size, block.experts.num_experts
    flat = routing.experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat, block.num_experts).view(ep, local)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=block.ep_group)  # [source rank, local expert]
    send_splits, recv_splits = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    received = _all_to_all(x[order // block.top_k], recv_splits, send_splits, block.ep_group)
    local_expert = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
    regroup = torch.argsort(local_expert, stable=True)
    return received[regroup], recv_counts.sum(0), _Dispatched(order, send_splits, recv_splits, regroup)


def _combine(block: MoEBlock, y_local: torch.Tensor, routing: Routing, state: _Dispatched, n_tokens: int):
    back = torch.empty_like(state.regroup)
    back[state.regroup] = torch.arange(len(state.regroup), device=y_local.device)
    y_sorted = _all_to_all(y_local[back], state.send_splits, state.recv_splits, block.ep_group)
    return MoEBlock.combine(block, y_sorted, routing, state.order, n_tokens)


def shard_experts(block: MoEBlock, ep_rank: int, ep_size: int, ep_group: dist.ProcessGroup) -> None:
    """Keep experts [ep_rank * E/ep, (ep_rank + 1) * E/ep) and route token-slots by all-to-all."""
    if block.num_experts % ep_size:
        raise LayoutError(f"ep={ep_size} must divide num_experts={block.num_experts}")
    local = block.num_experts // ep_size
    full = block.experts
    with torch.device(full.down_proj.device):  # meta stays meta: nothing allocated, nothing copied
        sliced = GroupedExperts(local, full.down_proj.shape[1], full.down_proj.shape[2]).to(full.down_proj.dtype)
    if not full.down_proj.is_meta:
        with torch.no_grad():
            rows = slice(ep_rank * local, (ep_rank + 1) * local)
            sliced.gate_up_proj.copy_(full.gate_up_proj[rows])
            sliced.down_proj.copy_(full.down_proj[rows])
    block.experts = sliced
    block.ep_size, block.ep_rank, block.ep_group = ep_size, ep_rank, ep_group
    block.expert_offset = ep_rank * local
    block.dispatch = types.MethodType(_dispatch, block)
    block.combine = types.MethodType(_combine, block)
