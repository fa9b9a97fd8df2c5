"""The built-in engine with expert parallelism: one process per GPU, each holding 1/ep of every MoE
layer's experts; token-slots travel to the experts' owner and back by all-to-all in every MoE layer.

Attention, router and LM head are replicated and each process serves its own sequences (data-parallel
attention, as in wide-EP serving), so the only traffic is the per-layer dispatch/combine. The
all-to-alls are the trainer's (`node.distributed.experts`), so engine and trainer route the same way.

Invariant: every rank runs the same number of model forwards per `step()`, in the same order
(prefill, then decode), because each MoE layer is a collective. A rank with nothing to prefill or
decode while another has runs a one-token forward without KV cache whose output it throws away.
`step()`, `has_work_anywhere()` and `generate()` are therefore collective: all ranks call them together.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from node.engine.engine import Completion, Engine, Request, _Sequence
from node.model.checkpoint import InvalidCheckpoint, hf_to_internal
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

    def check_version(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The version in internal names (experts stacked), refused with `InvalidCheckpoint` unless its
        names and shapes are the whole model's."""
        internal = hf_to_internal(state_dict, self.model.config)
        want = self.full_shapes()
        if sorted(want) != sorted(internal):
            raise InvalidCheckpoint(f"tensor names differ: missing {sorted(set(want) - set(internal))[:3]}, "
                                    f"unexpected {sorted(set(internal) - set(want))[:3]}")
        for name, shape in want.items():
            if tuple(internal[name].shape) != shape:
                raise InvalidCheckpoint(f"{name}: shape {tuple(internal[name].shape)}, the model's is {shape}")
        return internal

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        state_dict, version = pending
        internal = self.check_version(state_dict)  # all checked first: a rejected version leaves the weights untouched
        with torch.no_grad():
            for name, p in self.model.state_dict().items():
                t = internal[name]
                if ".mlp.experts." in name:
                    block = self.model.get_submodule(name.rsplit(".experts.", 1)[0])
                    t = t[block.expert_offset : block.expert_offset + block.experts.num_experts]
                p.copy_(t)
        self.version = version

    @torch.no_grad()
    def receive_version(self, version: int, internal: dict[str, torch.Tensor] | None = None, src: int = 0) -> None:
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

    @torch.inference_mode()
    def step(self) -> list[Completion]:
        self._apply_pending()
        decoding = sorted(self.running.values(), key=lambda s: s.slot)
        admitted = []
        self._free.sort(reverse=True)
        while self.waiting and self._free:
            seq = _Sequence(self.waiting.popleft(), self._free.pop())
            self.running[seq.slot] = seq
            admitted.append(seq)
        any_prefill, any_decode = self._any(bool(admitted), bool(decoding))
        finished: list[Completion] = []
        if any_prefill:
            finished += self._prefill(admitted) if admitted else self._idle_forward() or []
        if any_decode:
            finished += self._decode(decoding) if decoding else self._idle_forward() or []
        return finished

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Collective: run this rank's `requests` to completion while the others run theirs."""
        for r in requests:
            self.add_request(r)
        done: dict[str, Completion] = {}
        while self.has_work_anywhere():
            for c in self.step():
                done[c.request_id] = c
        return [done[r.request_id] for r in requests]
