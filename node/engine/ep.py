"""The built-in engine with expert parallelism: one process per GPU, each holding 1/ep of every MoE
layer's experts; token-slots travel to the experts' owner and back by all-to-all in every MoE layer.

Attention, router and LM head are replicated and each process serves its own sequences (data-parallel
attention, as in wide-EP serving), so the only traffic is the per-layer dispatch/combine. The
all-to-alls are the trainer's (`node.distributed.experts`), so engine and trainer route the same way.

Invariant: every rank runs the same number of model forwards per `step()`, in the same order
(prefill, then decode), because each MoE layer is a collective. A rank with nothing to prefill or
decode while another has runs a one-token forward without KV cache whose output it throws away.
`step()`, `has_work_anywhere()` and `generate()` (the core's, which steps while any rank has work) are
therefore collective: all ranks call them together. What differs from `Engine` is only that: the
step's forwards (`_run`), the question of more work, and the version swap (each rank its experts' rows).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from node.engine.core import Completion, SlotSequence
from node.engine.engine import Engine
from node.engine.weights import check_weights
from node.model.moe import MoEBlock
from node.model.qwen3_moe import CausalLM
from node.distributed.experts import shard_experts


def shard_model_experts(model: CausalLM, group: dist.ProcessGroup) -> CausalLM:
    """Keep this rank's slice of every MoE layer's experts and route token-slots by all-to-all."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoEBlock) and not hasattr(layer.mlp, "ep_group"):
            dtype = layer.mlp.experts.down_proj.dtype
            shard_experts(layer.mlp, rank, ep, group)
            layer.mlp.experts.to(dtype)  # shard_experts builds the slice in the default dtype
    return model


class EPEngine(Engine):
    def __init__(self, model: CausalLM, group: dist.ProcessGroup | None = None, **kwargs):
        self.group = group or dist.group.WORLD
        super().__init__(shard_model_experts(model, self.group), **kwargs)

    # ---- weights: each rank keeps its rows of the stacked expert tensors ------------------
    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape in the whole model (expert tensors: all experts, not this rank's)."""
        ep = dist.get_world_size(self.group)
        return {name: (p.shape[0] * ep, *p.shape[1:]) if ".mlp.experts." in name else tuple(p.shape)
                for name, p in self.model.state_dict().items()}

    def check_version(self, state_dict: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The version in internal names (experts stacked as each is looked up: one layer's at a time),
        refused with `WeightsMismatch` unless its names and shapes are the whole model's."""
        return check_weights(state_dict, self.model.config, self.full_shapes())

    def _check_weights(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state_dict  # checked whole when swapped (each rank keeps only its experts' rows)

    def _swap_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        internal = self.check_version(state_dict)  # all checked first: a rejected version leaves the weights untouched
        with torch.no_grad():
            for name, p in self.model.state_dict().items():
                t = internal[name]
                if ".mlp.experts." in name:
                    block = self.model.get_submodule(name.rsplit(".experts.", 1)[0])
                    t = t[block.expert_offset : block.expert_offset + block.experts.num_experts]
                p.copy_(t)

    @torch.no_grad()
    def receive_version(self, version: int, internal: Mapping[str, torch.Tensor] | None = None, src: int = 0) -> None:
        """Collective: rank `src` passes a checked version (`check_version`), every other rank None;
        non-expert tensors are broadcast, expert tensors scattered (each rank receives only its experts'
        rows), straight into the parameters. Call between two steps on every rank together."""
        ep = dist.get_world_size(self.group)
        for name, p in sorted(self.model.state_dict().items()):
            if ".mlp.experts." in name:
                chunks = list(internal[name].to(p.device, p.dtype).contiguous().chunk(ep)) if internal is not None else None
                dist.scatter(p, chunks, src=src, group=self.group)
            else:
                if internal is not None:
                    p.copy_(internal[name])
                dist.broadcast(p, src=src, group=self.group)
        self.version = version

    # ---- the collective loop -------------------------------------------------------------
    def _any(self, *flags: bool) -> list[bool]:
        t = torch.tensor([int(f) for f in flags], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(v) for v in t.tolist()]

    def has_work_anywhere(self) -> bool:
        return self._any(self.has_work())[0]

    def _idle_forward(self) -> None:
        """Take part in every MoE layer's all-to-all with one throwaway token."""
        one = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.model(one, one)

    def _run(self, admitted: list[SlotSequence], decoding: list[SlotSequence]) -> list[Completion]:
        any_prefill, any_decode = self._any(bool(admitted), bool(decoding))
        return self._together(self._prefill, admitted, any_prefill) + self._together(self._decode, decoding, any_decode)

    def _together(self, forward, seqs: list[SlotSequence], anywhere: bool) -> list[Completion]:  # noqa: ANN001
        """`forward(seqs)` where this rank has sequences; a throwaway forward where only another rank has."""
        if seqs:
            return forward(seqs)
        if anywhere:
            self._idle_forward()
        return []
