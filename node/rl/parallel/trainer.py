"""The distributed optimizer step. Invariant: with the loss divided by the GLOBAL count of loss
tokens and gradients summed across ranks, every parallel layout computes the loss and gradients
of one process on the whole batch (up to float reassociation). The gradient-norm clip is global too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from node.model.qwen3_moe import CausalLM
from node.rl.batch import TrainBatch
from node.rl.loss import policy_loss, token_logprobs
from node.rl.parallel.apply import is_expert_param, sync_gradients
from node.rl.parallel.context import sequence_slice
from node.rl.parallel.dims import ParallelGroups
from node.rl.trainer import TrainerConfig


@dataclass
class LocalBatch:
    """This rank's rows and sequence slice, with the global positions of the slice."""

    batch: TrainBatch
    positions: torch.Tensor  # [B_local, T_local]

    def to(self, device: torch.device) -> "LocalBatch":
        b = self.batch
        moved = TrainBatch(*(x.to(device) for x in (b.input_ids, b.targets, b.loss_mask, b.inference_logprobs,
                                                     b.advantages)),
                           None if b.routed_experts is None else b.routed_experts.to(device))
        return LocalBatch(moved, self.positions.to(device))


def _pad_seq(t: torch.Tensor, length: int) -> torch.Tensor:
    pad = length - t.shape[1]
    if pad == 0:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], dim=1)


def shard_batch(batch: TrainBatch, groups: ParallelGroups) -> LocalBatch:
    """Rows split evenly over dp ranks (the batch size must divide), sequence over cp ranks."""
    dims = groups.dims
    if len(batch) % dims.dp:
        raise ValueError(f"batch of {len(batch)} rows does not split over dp={dims.dp}")
    per = len(batch) // dims.dp
    local = batch.select(torch.arange(groups.dp_rank * per, (groups.dp_rank + 1) * per))
    t = local.input_ids.shape[1]
    padded = -(-t // dims.cp) * dims.cp
    cols = sequence_slice(padded, groups.cp_rank, dims.cp)
    fields = [_pad_seq(x, padded)[:, cols] for x in (local.input_ids, local.targets, local.loss_mask,
                                                      local.inference_logprobs, local.advantages)]
    experts = None if local.routed_experts is None else _pad_seq(local.routed_experts, padded)[:, cols]
    positions = torch.arange(padded)[cols].expand(per, -1)
    return LocalBatch(TrainBatch(*fields, experts), positions)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class DistributedTrainer:
    def __init__(self, model: CausalLM, groups: ParallelGroups, cfg: TrainerConfig = TrainerConfig(), seed: int = 0):
        self.model, self.groups, self.cfg = model, groups, cfg
        # foreach=False: expert and dense parameters live on different meshes, and a fused
        # multi-tensor op across meshes is refused by DTensor.
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           betas=(0.9, 0.99), foreach=False)
        self.generator = torch.Generator().manual_seed(seed)
        self.step = 0

    def loss(self, local: LocalBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """This rank's share of the global loss: its token sum over the global token count."""
        b = local.batch
        out = self.model(b.input_ids, positions=local.positions,
                         routed_experts=b.routed_experts if self.cfg.router_replay else None)
        logp = token_logprobs(out.logits, b.targets, self.cfg.temperature)
        po = policy_loss(logp, b.inference_logprobs, b.advantages, b.loss_mask, self.cfg.loss)
        n_local = b.loss_mask.sum()
        n_global = n_local.clone().float()
        dist.all_reduce(n_global)
        # policy_loss divided by max(n_local, 1); rescale to the global denominator.
        loss = po.loss * n_local.clamp(min=1) / n_global.clamp(min=1)
        # The aux loss is per rank (each rank's routing statistics), weighted by its token share.
        loss = loss + self.model.config.router_aux_loss_coef * out.aux_loss / self.groups.dims.world
        return loss, {"masked_share": po.masked_share, "mismatch_kl": po.mismatch_kl}

    def backward(self, local: LocalBatch) -> float:
        """Loss (summed over ranks) and gradients; after this, gradients are the global ones."""
        loss, _ = self.loss(local)
        loss.backward()
        sync_gradients(self.model, self.groups)
        total = loss.detach().clone()
        dist.all_reduce(total)
        return float(total)

    def clip_grad_norm(self, max_norm: float) -> float:
        g, dims = self.groups, self.groups.dims
        # accumulators live where the gradients do: NCCL reduces only device tensors
        device = next(self.model.parameters()).device
        dense = torch.zeros((), dtype=torch.float64, device=device)
        expert = torch.zeros((), dtype=torch.float64, device=device)
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            sq = _local(p.grad).double().pow(2).sum()
            if is_expert_param(name) and dims.ep > 1:
                expert += sq
            else:
                dense += sq
        if dims.fsdp:  # shards: sum them over the meshes they are sharded on
            dist.all_reduce(dense, group=g.world_mesh.get_group())
            dist.all_reduce(expert, group=g.expert_mesh.get_group())
        if dims.ep > 1:  # each EP rank holds different experts
            dist.all_reduce(expert, group=g.ep_group)
        norm = float((dense + expert).sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    def train_step(self, local: LocalBatch) -> dict[str, float]:
        """Same schedule as `Trainer.train_step`; every rank draws the same minibatch permutation."""
        self.model.train()
        local = local.to(next(self.model.parameters()).device)
        metrics: dict[str, float] = {}
        rows = len(local.batch)
        for _ in range(self.cfg.updates_per_batch):
            order = torch.randperm(rows, generator=self.generator)
            for chunk in order.chunk(self.cfg.minibatches):
                mb = LocalBatch(local.batch.select(chunk), local.positions[chunk])
                self.optimizer.zero_grad(set_to_none=True)
                metrics["loss"] = self.backward(mb)
                metrics["grad_norm"] = self.clip_grad_norm(self.cfg.max_grad_norm)
                self.optimizer.step()
        self.step += 1
        self.model.eval()
        return metrics

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole gradient, in one-process layout (collective: all ranks call)."""
        return self._gather(lambda p: p.grad)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self._gather(lambda p: p.detach())

    def _gather(self, get) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.model.named_parameters():
            t = get(p)
            t = t.full_tensor() if isinstance(t, DTensor) else t
            if is_expert_param(name) and self.groups.dims.ep > 1:
                parts = [torch.empty_like(t) for _ in range(self.groups.dims.ep)]
                dist.all_gather(parts, t.contiguous(), group=self.groups.ep_group)
                t = torch.cat(parts, dim=0)
            out[name] = t.detach().clone()
        return out
