"""Mixture-of-Experts block: router, dispatch, grouped expert compute, combine.

The three stages are separate so that parallelism is applied from outside the model: expert
parallelism replaces `dispatch`/`combine` with an all-to-all and gives each rank a slice of
`GroupedExperts`; FP8 replaces `GroupedExperts` with a quantised twin. The block never assumes
all experts live in this process beyond calling `self.experts(x_sorted, counts)` (on rows `dispatch` took from
`self.experts.dispatchable(x)`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)
FUSED_COMBINE: ContextVar[Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor] | None] = ContextVar(
    "fused_combine", default=None)
"""The combine as one kernel, (y_sorted, rows, weights, top_k) -> out, where a caller sets it (the engine's forward
and the validator's recomputation on a GPU: `node.engine.moe_kernels.moe_combine`); CUDA tensors outside autograd
only, so a trainer's forward and backward stay these ops."""
_warned_host_path: set[torch.dtype] = set()
"""Dtypes whose host-synced expert path on a GPU this process has logged."""


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked weights (transformers-5 fused layout).

    `gate_up_proj[e]` is [2I, H] (gate rows first, then up rows); `down_proj[e]` is [H, I].
    """

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def dispatchable(self, x: torch.Tensor) -> torch.Tensor:
        """The block's token rows in the form `dispatch` copies to the experts (`forward` takes its rows): here `x`
        itself; an FP8 twin quantises them first (node/engine/fp8/model.py)."""
        return x

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of `x_sorted` are grouped by expert, `counts[e]` rows for expert e, in order."""
        if x_sorted.is_cuda and x_sorted.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            gu = torch._grouped_mm(x_sorted, self.gate_up_proj.transpose(-2, -1), offs=offs)
            gate, up = gu.chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)
        if x_sorted.is_cuda and x_sorted.dtype not in _warned_host_path:  # a slow path is said once, never silent
            _warned_host_path.add(x_sorted.dtype)
            why = "torch._grouped_mm takes bfloat16 only" if hasattr(torch, "_grouped_mm") else "no torch._grouped_mm"
            log.warning("MoE experts on %s in %s: each layer reads its expert counts back to the host (no CUDA graph "
                        "can hold it) and runs a padded batched matmul or a loop over experts (%s)",
                        x_sorted.device, x_sorted.dtype, why)
        counts_list = counts.tolist()
        capacity = max(counts_list)
        if capacity * self.num_experts <= 2 * x_sorted.shape[0]:
            return self._padded_bmm(x_sorted, counts, capacity)
        out = torch.empty_like(x_sorted)
        start = 0
        for e, n in enumerate(counts_list):
            if n:
                rows = x_sorted[start : start + n]
                gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
                out[start : start + n] = F.linear(F.silu(gate) * up, self.down_proj[e])
                start += n
        return out

    def _padded_bmm(self, x_sorted: torch.Tensor, counts: torch.Tensor, capacity: int) -> torch.Tensor:
        """All experts in two batched matmuls over rows padded to the fullest expert's count: a few
        large ops instead of a loop of small ones, used when routing is balanced enough that the
        padding costs less than the loop's per-expert overhead."""
        e_of_row = torch.repeat_interleave(torch.arange(self.num_experts, device=x_sorted.device), counts)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(x_sorted.shape[0], device=x_sorted.device) - starts[e_of_row]
        buf = x_sorted.new_zeros(self.num_experts, capacity, x_sorted.shape[-1])
        buf[e_of_row, slot] = x_sorted
        gate, up = torch.bmm(buf, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, self.down_proj.transpose(1, 2))[e_of_row, slot]


def expert_counts(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert. Unlike `torch.bincount`, no host synchronisation on CUDA, so a decode
    step that routes tokens can be captured in a CUDA graph."""
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    return counts.index_add_(0, flat, torch.ones_like(flat))


@dataclass
class Routing:
    logits: torch.Tensor  # [N, E] router logits
    experts: torch.Tensor  # [N, k] chosen expert ids
    weights: torch.Tensor  # [N, k] combine weights


class MoEBlock(nn.Module):
    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, hidden, inter)

    def route(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> Routing:
        """Top-k routing; with `replay` ([N, k] expert ids) the given experts are used and only
        their weights come from this router (router replay)."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if replay is None:
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
        else:
            experts = replay.to(device=x.device, dtype=torch.long)
            weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(logits, experts, weights.to(x.dtype))

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copy each token once per chosen expert, grouped by expert. Returns (x_sorted, counts, order)."""
        flat = routing.experts.reshape(-1)
        # the same stable order from 16-bit keys: a GPU's radix sort makes a pass per key byte (the int64 sort
        # was 28 us of every layer of a batch-128 decode step on an H100, 5% of the step's kernels)
        keys = flat.to(torch.int16) if self.num_experts <= torch.iinfo(torch.int16).max else flat
        order = torch.argsort(keys, stable=True)
        counts = expert_counts(flat, self.num_experts)
        return x[order // self.top_k], counts, order

    def combine(self, y_sorted: torch.Tensor, routing: Routing, order: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """Each token's k expert outputs, weighted by the router, summed in a fixed order: the rows are put back
        in token order (a gather by the inverse of `order`; no two threads write one row) and summed over k with
        float32 accumulation, one rounding. Repeatable on a GPU, where an `index_add_` of bf16 rows adds them in
        whatever order its atomics land (the way before session 25, `PRIMERL_MOE_COMBINE=index_add`, kept to
        measure against: a seeded request's tokens could differ between two runs on the same weights). Where a
        caller set `FUSED_COMBINE` (the engine's forward and the validator's recomputation on a GPU), outside
        autograd, one kernel does it (`PRIMERL_MOE_COMBINE=gather` keeps these ops)."""
        way = os.environ.get("PRIMERL_MOE_COMBINE")
        if way == "index_add":
            y = y_sorted * routing.weights.reshape(-1)[order].unsqueeze(-1)
            out = torch.zeros(n_tokens, y.shape[-1], dtype=y.dtype, device=y.device)
            return out.index_add_(0, order // self.top_k, y)
        inverse = torch.empty_like(order)  # where each token's choice sits among the sorted rows
        inverse[order] = torch.arange(order.numel(), device=order.device)
        fused = FUSED_COMBINE.get()
        if fused is not None and way is None and y_sorted.is_cuda and not torch.is_grad_enabled():
            return fused(y_sorted, inverse, routing.weights.reshape(-1), self.top_k)
        y = y_sorted * routing.weights.reshape(-1)[order].unsqueeze(-1)
        return y[inverse].view(n_tokens, self.top_k, -1).sum(dim=1)

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> tuple[torch.Tensor, Routing]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        routing = self.route(x, replay)
        x_sorted, counts, order = self.dispatch(self.experts.dispatchable(x), routing)
        y_sorted = self.experts(x_sorted, counts)
        return self.combine(y_sorted, routing, order, x.shape[0]).reshape(shape), routing


def load_balancing_loss(router_logits: list[torch.Tensor], experts: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss: E * sum_e f_e * P_e, averaged over MoE layers, where f_e
    is the share of routed token-slots sent to e and P_e the mean router probability of e."""
    total = router_logits[0].new_zeros((), dtype=torch.float32)
    for logits, chosen in zip(router_logits, experts):
        probs = torch.softmax(logits.float(), dim=-1)
        f = expert_counts(chosen.reshape(-1), num_experts).float() / chosen.numel()
        total = total + num_experts * (f * probs.mean(0)).sum()
    return total / max(len(router_logits), 1)
