"""How many sequences an engine on a GPU decodes at once: its KV slots sized from the memory that is
free when it starts, with one knob (the share of that memory the engine may take), and a plan
printed before anything is allocated.

Every role plans too (`MemoryPlan`, from the ModelConfig's parameter counts, before the model is built):
weights, KV cache, activations and logits, and a trainer's gradients and AdamW states, against what its
device has free (cpu: host RAM; cuda: free GPU memory); node/roles/memory.py makes the plan each role prints at start.

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
    """What a role needs (an engine's weights and fewest KV slots, a trainer's weights, gradients and
    optimizer states, a validator's resident model and logits) exceeds what its device has free."""


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


def kv_token_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token, every layer."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def slot_bytes(cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype) -> int:
    """What one sequence of `max_seq_len` tokens holds on the device: K and V of every layer, and the
    engine's per-position slot state (the final hidden state for proofs, the sampling seed and
    logprob, the routed experts of each MoE layer)."""
    item = torch.empty((), dtype=dtype).element_size()
    kv = kv_token_bytes(cfg, dtype)
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


# ---- every role's plan: what it will hold on its device, from the ModelConfig alone ------------------

FP8_BLOCK = 128
"""Block edge of the FP8 weights' float32 scales (node/fp8/quantize.py: 128 x 128 blocks)."""
ADAMW_STATES = 2
"""AdamW keeps exp_avg and exp_avg_sq per parameter, each `zeros_like(param)`: the parameter's dtype."""


@dataclass(frozen=True)
class MemoryPlan:
    """What one role will hold on one device (bytes per part), planned before the model exists."""

    role: str
    device: str
    parts: tuple[tuple[str, int], ...]
    free_bytes: int
    """What the device has free now (cpu: MemAvailable; cuda: `mem_get_info`), or the limit asked for."""
    note: str = ""
    micro_batch_tokens: int | None = None
    """A trainer's: the padded tokens of one forward/backward, as planned (`plan_trainer`)."""

    @property
    def total(self) -> int:
        return sum(b for _, b in self.parts)

    def describe(self) -> str:
        parts = " + ".join(f"{name} {size(b)}" for name, b in self.parts if b)
        note = f" ({self.note})" if self.note else ""
        return f"memory plan: {self.role} on {self.device}: {parts} = {size(self.total)} of {size(self.free_bytes)} free{note}"

    def check(self) -> "MemoryPlan":
        """The plan; `MemoryPlanDoesNotFit` (one line with the numbers) when it exceeds what is free."""
        if self.total > self.free_bytes:
            parts = ", ".join(f"{name} {size(b)}" for name, b in self.parts if b)
            raise MemoryPlanDoesNotFit(
                f"the {self.role} needs {size(self.total)} on {self.device} ({parts}{'; ' + self.note if self.note else ''}) "
                f"but {size(self.free_bytes)} is free: use a larger device, more ranks, or a smaller model")
        return self


def size(n: int) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def expert_params(cfg: ModelConfig) -> int:
    """Parameters of the routed experts (every MoE layer's gate_up and down projections)."""
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return n_moe * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size


def projection_params(cfg: ModelConfig) -> int:
    """Parameters of the decoder's dense projections (attention q/k/v/o, dense MLPs), experts excluded."""
    h = cfg.hidden_size
    attn = h * cfg.head_dim * 2 * (cfg.num_attention_heads + cfg.num_key_value_heads)
    dense = sum(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) * 3 * h * cfg.intermediate_size
    return cfg.num_hidden_layers * attn + dense


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, fp8: str = "off") -> int:
    """Bytes of the weights in `dtype`, the FP8 mode's projections at one byte plus their block scales."""
    item = torch.empty((), dtype=dtype).element_size()
    quantised = {"off": 0, "experts": expert_params(cfg), "all": expert_params(cfg) + projection_params(cfg)}[fp8]
    scales = quantised // (FP8_BLOCK * FP8_BLOCK) * 4
    return (cfg.num_parameters() - quantised) * item + quantised + scales


TRAIN_ACTIVATION_SCALE = 1.75
"""What autograd keeps of a training token, over the tensors `token_activation_bytes` counts: measured on one
H200 (session 15, `python -m benchmarks.trainer_profile`): the 5.2B `qwen3-30b-a3b-8l` trainer in bf16 peaked at
73.0 GiB allocated with 16,384-token micro-batches, where the count gave 60.4 GiB (16.8 GiB of activations);
it misses the float32 copies the norms save, the SiLU's saved gate and up, the MoE combine's saved outputs.
Applied to a trainer's activations without checkpointing (the plan's 73.0 GiB there)."""


def token_activation_bytes(cfg: ModelConfig, dtype: torch.dtype, train: bool, checkpointed: bool = False) -> int:
    """Activations of one token: under autograd the tensors each decoder layer saves for the backward
    (residual, norms, q/k/v and attention output, router logits, the top-k experts' inputs, gate/up and
    activation), all layers (`checkpointed`: each layer's input, and one layer's set recomputed in the
    backward); without autograd the largest layer's working set. The logits are counted apart."""
    item = torch.empty((), dtype=dtype).element_size()
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attn = 4 * h + 2 * q + 2 * kv
    moe = cfg.num_experts + cfg.num_experts_per_tok * (2 * h + 3 * cfg.moe_intermediate_size)
    dense = 3 * cfg.intermediate_size + h
    layers = [attn + (moe if cfg.is_moe_layer(i) else dense) for i in range(cfg.num_hidden_layers)]
    if train and checkpointed:
        return (cfg.num_hidden_layers * h + max(layers)) * item
    return int(sum(layers) * item * TRAIN_ACTIVATION_SCALE) if train else max(layers) * item


def gpu_memory_stats(device: str | torch.device) -> dict[str, float]:
    """This process's CUDA allocator on `device`, in GiB: what it holds (reserved), and the peaks of what
    its tensors used and it held since start ({} off a GPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    return {"gpu_reserved_gib": round(torch.cuda.memory_reserved(device) / GIB, 2),
            "gpu_peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / GIB, 2),
            "gpu_peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / GIB, 2)}


def host_or_gpu_free(device: str, limit_gib: float | None = None) -> int:
    """What `device` has free now (cpu: MemAvailable; cuda: free GPU memory), at most `limit_gib` when given."""
    from node.model.spec import available_memory

    free = available_memory(device)
    return free if limit_gib is None else min(free, int(limit_gib * GIB))


MICRO_BATCH_SHARE = 0.5
"""Of the memory a trainer rank has free after its weights, gradients and AdamW states, the share one
micro-batch's activations and logits may take when the micro-batch is sized from it (the rest: the
published version's copies, the allocator's slack, other roles on the device)."""


def plan_trainer(cfg: ModelConfig, dtype: torch.dtype, device: str, free_bytes: int, micro_batch_tokens: int,
                 logprob_chunk_bytes: int, world: int = 1, sharded: bool = True, checkpointed: bool = False,
                 longest_row: int | None = None) -> MemoryPlan:
    """One trainer rank: weights, gradients and AdamW's two states in the parameters' dtype, divided by the
    FSDP world when sharded; the activations and logits of one micro-batch (`micro_batch_tokens` padded
    tokens, split over the world): the logits and their gradient in the model's dtype, and twice the
    float32 chunk `token_logprobs` scores at once (`logprob_chunk_bytes`, node/rl/loss.py: the chunk and
    its recomputation in the backward). With `longest_row` (the run's sequence limit) the micro-batch is
    sized from what is free: at most `micro_batch_tokens`, at least one such row (`MemoryPlan.micro_batch_tokens`)."""
    share = world if sharded else 1
    weights = weight_bytes(cfg, dtype) // share
    item = torch.empty((), dtype=dtype).element_size()
    per_token = token_activation_bytes(cfg, dtype, train=True, checkpointed=checkpointed) + cfg.vocab_size * (2 * item + 8)
    if longest_row is not None:
        room = max(0, free_bytes - (2 + ADAMW_STATES) * weights)
        micro_batch_tokens = max(longest_row, min(micro_batch_tokens, int(MICRO_BATCH_SHARE * room) // per_token * world))
    tokens = -(-micro_batch_tokens // world)
    logits = tokens * cfg.vocab_size * 2 * item + 2 * min(logprob_chunk_bytes, tokens * cfg.vocab_size * 4)
    name = str(dtype).removeprefix("torch.")
    return MemoryPlan("trainer", device, (("weights", weights), ("gradients", weights),
                                          ("AdamW states", ADAMW_STATES * weights),
                                          ("activations", tokens * token_activation_bytes(cfg, dtype, train=True, checkpointed=checkpointed)),
                                          ("logits", logits)),
                      free_bytes, f"AdamW {ADAMW_STATES} states in {name}, {micro_batch_tokens} tokens a micro-batch, "
                                  f"FSDP world {share}" + (", activation checkpointing" if checkpointed else ""),
                      micro_batch_tokens)


def plan_validator(cfg: ModelConfig, dtype: torch.dtype, device: str, free_bytes: int, fp8: str,
                   logits_bytes: int, batch_tokens: int) -> MemoryPlan:
    """A validator: one resident model (other versions as deltas on the host, node/roles/resident_policy.py),
    a prefill group's logits (float32, its budget), activations, and the keys and values of a group of
    mixed-version claims recomputed version by version (node/replay.py `_PackedMixed` / `_MixedBatch`)."""
    return MemoryPlan("validator", device, (("resident model", weight_bytes(cfg, dtype, fp8)),
                                            ("logits", logits_bytes),
                                            ("activations", batch_tokens * token_activation_bytes(cfg, dtype, train=False)),
                                            ("mixed-version KV", batch_tokens * kv_token_bytes(cfg, dtype))),
                      free_bytes, "one resident model; other versions as deltas, sized as they arrive")


def plan_inference(cfg: ModelConfig, dtype: torch.dtype, device: str, free_bytes: int, fp8: str, max_seq_len: int,
                   slots: int) -> MemoryPlan:
    """An inference engine: weights, the KV cache of `slots` sequences (on a GPU the fewest it needs: the
    engine sizes the rest from what is free after its weights, `plan_slots`), and per decode step each
    slot's activations and float32 logits."""
    kv = (slots + 1) * slot_bytes(cfg, max_seq_len, dtype)
    step = slots * (token_activation_bytes(cfg, dtype, train=False) + 4 * cfg.vocab_size)
    at_least = " at least" if device.startswith("cuda") else ""
    return MemoryPlan("inference node", device, (("weights", weight_bytes(cfg, dtype, fp8)), ("KV cache", kv),
                                                 ("activations and logits", step)),
                      free_bytes, f"KV for{at_least} {slots} sequences of {max_seq_len} tokens")
