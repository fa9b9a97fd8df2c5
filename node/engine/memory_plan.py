"""How many sequences an engine on a GPU decodes at once: its KV slots sized from the memory that is
free when it starts, with one knob (the share of that memory the engine may take), and a plan
printed before anything is allocated.

Invariant: the plan is made, logged and checked before the KV cache exists; a plan that cannot hold
the slots a node needs is one line naming the numbers (`MemoryPlanDoesNotFit`, exit 2), never a raw
CUDA out-of-memory error after allocating.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from node.engine.registry import EngineUnavailable
from node.model.config import ModelConfig

log = logging.getLogger(__name__)

GIB = 1 << 30
MAX_SLOTS = 512
"""Most sequences one engine decodes at once (its largest CUDA-graph bucket)."""
ACTIVATION_SHARE = 0.1
"""Of the engine's budget, kept back for activations, logits and graph pools (not KV)."""


class MemoryPlanDoesNotFit(EngineUnavailable):
    """The engine's weights and the fewest KV slots it needs exceed its share of free GPU memory."""


@dataclass(frozen=True)
class KVPlan:
    slots: int
    """Sequences decoded at once (KV slots, one more is the engine's scratch slot)."""
    slot_bytes: int
    """KV bytes of one slot at the engine's sequence limit."""
    free_bytes: int
    """Free device memory when planned (the weights already resident)."""
    budget_bytes: int
    """The engine's share of it for KV."""

    def describe(self) -> str:
        return (f"KV plan: {self.slots} slots x {self.slot_bytes / GIB * 1024:.1f} MiB = "
                f"{self.slots * self.slot_bytes / GIB:.2f} GiB of a {self.budget_bytes / GIB:.2f} GiB budget "
                f"({self.free_bytes / GIB:.1f} GiB free)")


def slot_bytes(cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype) -> int:
    """What one sequence of `max_seq_len` tokens holds on the device: K and V of every layer, and the
    engine's per-position slot state (the final hidden state for proofs, the sampling seed and
    logprob, the routed experts of each MoE layer)."""
    item = torch.empty((), dtype=dtype).element_size()
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * item
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    state = cfg.hidden_size * item + 8 + 4 + n_moe * cfg.num_experts_per_tok
    return (kv + state) * max_seq_len


def plan_slots(cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype, free_bytes: int, share: float,
               wanted: int, needed: int) -> KVPlan:
    """Slots for `wanted` sequences (at most what `share` of `free_bytes` holds after the activation
    reserve, at most MAX_SLOTS); `MemoryPlanDoesNotFit` below `needed` (one lease group)."""
    if not 0 < share <= 1:
        raise MemoryPlanDoesNotFit(f"gpu memory share {share} must lie in (0, 1]")
    per = slot_bytes(cfg, max_seq_len, dtype)
    budget = int(share * free_bytes * (1 - ACTIVATION_SHARE))
    fits = budget // (per or 1) - 1  # one scratch slot
    slots = min(wanted, fits, MAX_SLOTS)
    plan = KVPlan(max(slots, 0), per, free_bytes, budget)
    if slots < needed:
        raise MemoryPlanDoesNotFit(
            f"KV cache needs {(needed + 1) * per / GIB:.2f} GiB for {needed} sequences of {max_seq_len} tokens, "
            f"{budget / GIB:.2f} GiB available ({share:.0%} of {free_bytes / GIB:.1f} GiB free, "
            f"{ACTIVATION_SHARE:.0%} kept for activations): lower max_seq_len or raise --gpu-memory-share")
    return plan


def plan_on(device: torch.device, cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype, share: float,
            wanted: int, needed: int) -> KVPlan:
    """The plan on `device` now (CUDA: from `mem_get_info`; elsewhere `wanted` slots, unplanned)."""
    if device.type != "cuda":
        return KVPlan(wanted, slot_bytes(cfg, max_seq_len, dtype), 0, 0)
    free, _ = torch.cuda.mem_get_info(device)
    plan = plan_slots(cfg, max_seq_len, dtype, free, share, wanted, needed)
    log.info("%s", plan.describe())
    return plan
