"""The distributed optimizer step. Invariant: with the loss divided by the GLOBAL count of loss
tokens and gradients summed across ranks, every parallel layout computes the loss and gradients
of one process on the whole batch (up to float reassociation). The gradient-norm clip, the MoE
load-balancing loss, the learning-rate schedule and the minibatch schedule are global too, so
`train_step` on a batch takes the step `Trainer.train_step` takes on it when both draw the same
minibatch permutation (`Trainer` draws it from torch's global generator, seeded here per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from node.model.moe import expert_counts
from node.model.qwen3_moe import CausalLM, ModelOutput
from node.rl.batch import TrainBatch, loss_rows
from node.rl.loss import policy_loss
from node.rl.parallel.apply import is_expert_param, sync_gradients
from node.rl.parallel.context import sequence_slice
from node.rl.parallel.dims import LayoutError, ParallelDims, ParallelGroups, RankCoords
from node.rl.trainer import Trainer, TrainerConfig, logprobs_at


@dataclass
class LocalBatch:
    """This rank's rows and sequence slice, with the global positions of the slice."""

    batch: TrainBatch
    positions: torch.Tensor  # [B_local, T_local]
    real: torch.Tensor | None = None
    """[B_local, T_local] bool: tokens of the one-process batch (not sequence or row padding added
    to split it); the load-balancing loss counts these. None: every token is real."""

    def to(self, device: torch.device) -> "LocalBatch":
        b = self.batch
        moved = TrainBatch(*(x.to(device) for x in (b.input_ids, b.targets, b.loss_mask, b.inference_logprobs,
                                                     b.advantages)),
                           None if b.routed_experts is None else b.routed_experts.to(device))
        return LocalBatch(moved, self.positions.to(device), None if self.real is None else self.real.to(device))

    def select(self, rows: torch.Tensor) -> "LocalBatch":
        return LocalBatch(self.batch.select(rows), self.positions[rows], None if self.real is None else self.real[rows])


def _pad_seq(t: torch.Tensor, length: int) -> torch.Tensor:
    pad = length - t.shape[1]
    if pad == 0:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], dim=1)


def pad_rows(batch: TrainBatch, multiple: int) -> tuple[TrainBatch, int]:
    """Append rows with no loss tokens until the row count divides by `multiple`; returns the batch
    and its count of real rows. Such rows add nothing to the loss or the global token count."""
    real = len(batch)
    extra = -real % multiple
    if extra == 0:
        return batch, real
    idx = torch.cat([torch.arange(real), torch.zeros(extra, dtype=torch.long)])
    padded = batch.select(idx)
    padded.loss_mask[real:] = False
    return padded, real


def shard_batch(batch: TrainBatch, groups: ParallelGroups | RankCoords, real_rows: int | None = None) -> LocalBatch:
    """Rows split evenly over dp ranks (the batch size must divide), sequence over cp ranks.
    Rows from `real_rows` on are padding (see `pad_rows`)."""
    dims = groups.dims
    if len(batch) % dims.dp:
        raise LayoutError(f"batch of {len(batch)} rows does not split over dp={dims.dp}")
    per = len(batch) // dims.dp
    local = batch.select(torch.arange(groups.dp_rank * per, (groups.dp_rank + 1) * per))
    t = local.input_ids.shape[1]
    padded = -(-t // dims.cp) * dims.cp
    cols = sequence_slice(padded, groups.cp_rank, dims.cp)
    fields = [_pad_seq(x, padded)[:, cols] for x in (local.input_ids, local.targets, local.loss_mask,
                                                      local.inference_logprobs, local.advantages)]
    experts = None if local.routed_experts is None else _pad_seq(local.routed_experts, padded)[:, cols]
    positions = torch.arange(padded)[cols].expand(per, -1)
    rows = torch.arange(groups.dp_rank * per, (groups.dp_rank + 1) * per)
    real = (positions < t) & (rows < (len(batch) if real_rows is None else real_rows))[:, None]
    return LocalBatch(TrainBatch(*fields, experts), positions, real)


@dataclass
class RankWork:
    """One rank's share of a step: its part of each minibatch, in the order they are trained."""

    minibatches: list[LocalBatch]


def plan_rank(batch: TrainBatch, coords: RankCoords, cfg: TrainerConfig, seed: int) -> RankWork:
    """What rank `coords` trains on in a step over `batch`: `Trainer.train_step`'s minibatches
    (updates_per_batch passes, each a permutation drawn from a generator seeded with `seed`),
    each padded to a multiple of dp rows and sharded by `shard_batch`."""
    dp = coords.dims.dp
    generator = torch.Generator().manual_seed(seed)
    minibatches = []
    for _ in range(cfg.updates_per_batch):
        order = torch.randperm(len(batch), generator=generator)
        for rows in order.chunk(cfg.minibatches):
            mb, real = pad_rows(batch.select(rows), dp)
            minibatches.append(shard_batch(mb, coords, real))
    return RankWork(minibatches)


def plan_world(batch: TrainBatch, dims: ParallelDims, cfg: TrainerConfig, seed: int) -> list[RankWork]:
    """Every rank's `RankWork`, indexed by global rank (rank 0 scatters them)."""
    return [plan_rank(batch, RankCoords.of(dims, r), cfg, seed) for r in range(dims.world)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def minibatch_seed(seed: int, step: int) -> int:
    """Seed of the minibatch permutations of the step taken at `step` (before it)."""
    return seed * 1_000_003 + step


def balancing_loss_share(out: ModelOutput, real: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """This rank's share of the one-process load-balancing loss (`node.model.moe.load_balancing_loss`
    over the whole batch): E * sum_e f_e * P_e with f_e from the GLOBAL expert counts (a constant)
    and P_e's sum over this rank's real tokens divided by the GLOBAL token count. Shares sum over
    ranks to the one-process loss, and so do their gradients (collective: every rank calls)."""
    logits = out.router_logits
    if not logits:
        return out.logits.new_zeros(())
    n_tokens = logits[0].shape[0]
    keep = torch.ones(n_tokens, dtype=torch.bool, device=out.logits.device) if real is None else real.reshape(-1)
    chosen = out.routed_experts.reshape(n_tokens, len(logits), -1)[keep]  # [N_real, L, k]
    counts = torch.stack([expert_counts(chosen[:, i].reshape(-1), num_experts) for i in range(len(logits))])
    totals = torch.cat([counts.reshape(-1).float(), keep.sum().float().reshape(1)])
    dist.all_reduce(totals)
    f = totals[:-1].view(len(logits), num_experts) / (totals[-1].clamp(min=1) * chosen.shape[-1])
    share = out.logits.new_zeros((), dtype=torch.float32)
    for i, layer_logits in enumerate(logits):
        p_sum = torch.softmax(layer_logits.float()[keep], dim=-1).sum(0)
        share = share + num_experts * (f[i] * p_sum).sum() / totals[-1].clamp(min=1)
    return share / len(logits)


def mesh_groups(model: torch.nn.Module) -> list[dict]:
    """The model's parameters as optimizer parameter groups, one a device mesh (plain tensors one group of their
    own): expert and dense parameters live on different meshes, and DTensor refuses a multi-tensor op whose
    tensors span meshes, so each group's multi-tensor AdamW stays on one mesh."""
    by_mesh: dict = {}
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        key = None if mesh is None else (tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names)
        by_mesh.setdefault(key, []).append(p)
    return [{"params": params} for params in by_mesh.values()]


class DistributedTrainer:
    def __init__(self, model: CausalLM, groups: ParallelGroups, cfg: TrainerConfig = TrainerConfig(), seed: int = 0,
                 foreach: bool | None = None):
        """`foreach`: AdamW's multi-tensor path; None: PyTorch's choice (on GPUs the multi-tensor path, a kernel a
        few dozen tensors, instead of a loop launching each parameter's update ops in turn; on the CPU the loop)."""
        self.model, self.groups, self.cfg, self.seed = model, groups, cfg, seed
        self.optimizer = torch.optim.AdamW(mesh_groups(model), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           betas=(0.9, 0.99), foreach=foreach)
        self.step = 0

    learning_rate = Trainer.learning_rate  # one schedule: it reads only cfg and step

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def loss(self, local: LocalBatch, n_global: torch.Tensor | None = None,
             aux_weight: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
        """This rank's share of the global loss: its token sum over the global token count (`n_global`:
        that of the minibatch this micro-batch is part of; None: this batch's), plus its share of the
        load-balancing loss (times `aux_weight`). Metrics are global: `loss` is the policy loss alone,
        as `Trainer` reports it; `total` the whole loss summed over ranks."""
        b = local.batch
        logp, out = logprobs_at(self.model, b, loss_rows(b), self.cfg.temperature, positions=local.positions,
                                routed_experts=b.routed_experts if self.cfg.router_replay else None)
        po = policy_loss(logp, b.inference_logprobs, b.advantages, b.loss_mask, self.cfg.loss)
        n_local = b.loss_mask.sum()
        if n_global is None:
            n_global = self.global_tokens(local)
        # policy_loss divided by max(n_local, 1); rescale to the global denominator.
        loss = po.loss * n_local.clamp(min=1) / n_global.clamp(min=1)
        aux = balancing_loss_share(out, local.real, self.model.config.num_experts) \
            if torch.is_grad_enabled() else loss.new_zeros(())
        whole = loss + self.model.config.router_aux_loss_coef * aux * aux_weight
        stats = torch.stack([loss.detach().float(), n_local.float() * po.masked_share,
                             n_local.float() * po.mismatch_kl, aux.detach().float(), whole.detach().float()])
        dist.all_reduce(stats)
        n = float(n_global.clamp(min=1))
        return whole, {
            "loss": float(stats[0]), "masked_share": float(stats[1]) / n, "mismatch_kl": float(stats[2]) / n,
            "aux_loss": float(stats[3]), "total": float(stats[4])}

    def global_tokens(self, local: LocalBatch) -> torch.Tensor:
        """Loss tokens of the batch `local` is this rank's share of (collective)."""
        n = local.batch.loss_mask.sum().float()
        dist.all_reduce(n)
        return n

    def micro_batches(self, local: LocalBatch) -> list[LocalBatch]:
        """`local` in row chunks whose global padded tokens (every rank's share alike) stay within
        `micro_batch_tokens`; the chunk count is the largest any rank asks for (collective: each rank
        plans its own budget from its own free memory, and all must take the same collectives)."""
        b, t = local.batch.input_ids.shape
        pieces = torch.tensor(max(1, -(-(b * t * self.groups.dims.world) // self.cfg.micro_batch_tokens)),
                              device=self._device())
        dist.all_reduce(pieces, op=dist.ReduceOp.MAX)
        pieces = int(pieces)
        return [local] if pieces == 1 else [local.select(rows) for rows in torch.arange(b).chunk(pieces)]

    def _micro_loss(self, local: LocalBatch, backward: bool) -> dict[str, float]:
        """`loss` over `local`'s micro-batches, each normalised by `local`'s global token count (their
        gradients add up to the whole batch's; the load-balancing loss by each one's share of rows)."""
        micros = self.micro_batches(local)
        if len(micros) == 1:
            loss, stats = self.loss(local)
            if backward:
                loss.backward()
            return stats
        n_global = self.global_tokens(local)
        total = dict.fromkeys(("loss", "masked_share", "mismatch_kl", "aux_loss", "total"), 0.0)
        for micro in micros:
            rows = len(micro.batch) / len(local.batch)  # the aux share by rows: an approximation, as in `Trainer`
            loss, stats = self.loss(micro, n_global, aux_weight=rows)
            if backward:
                loss.backward()
            for k in ("loss", "masked_share", "mismatch_kl", "total"):
                total[k] += stats[k]
            total["aux_loss"] += stats["aux_loss"] * rows
        return total

    def backward(self, local: LocalBatch) -> float:
        """Loss (summed over ranks) and gradients; after this, gradients are the global ones."""
        return self._backward(local)[0]

    def _backward(self, local: LocalBatch) -> tuple[float, dict[str, float]]:
        stats = self._micro_loss(local, backward=True)
        sync_gradients(self.model, self.groups)
        return stats["total"], stats

    def clip_grad_norm(self, max_norm: float) -> float:
        g, dims = self.groups, self.groups.dims
        # accumulators live where the gradients do: NCCL reduces only device tensors
        device = self._device()
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
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.grad is not None:
                        _local(p.grad).mul_(coef)
        return norm

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """`Trainer.train_step` over the world when every rank holds the whole batch: each takes its
        own share (`plan_rank`) and trains on it (collective)."""
        return self.train_work(plan_rank(batch, RankCoords.of(self.groups.dims, dist.get_rank()),
                                         self.cfg, minibatch_seed(self.seed, self.step)))

    def train_work(self, work: "RankWork") -> dict[str, float]:
        """Take the step on this rank's share of the batch (collective): the same minibatches as
        `Trainer.train_step` draws, each split over the ranks; this rank holds only its rows and
        its sequence slice of each."""
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate()
        device = self._device()
        metrics: dict[str, float] = {"lr": self.learning_rate()}
        for local in work.minibatches:
            self.optimizer.zero_grad(set_to_none=True)
            _, stats = self._backward(local.to(device))
            metrics["grad_norm"] = self.clip_grad_norm(self.cfg.max_grad_norm)
            self.optimizer.step()
            metrics.setdefault("mismatch_kl", stats["mismatch_kl"])  # the first minibatch's, as `Trainer` reads it
            metrics.update(loss=stats["loss"], masked_share=stats["masked_share"], aux_loss=stats["aux_loss"])
        if device.type == "cuda":
            torch.cuda.synchronize()  # the step is over when its optimizer update is
        self.step += 1
        self.model.eval()
        return metrics

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole gradient, in one-process layout (collective: all ranks call;
        tests and the self-check only: training never gathers)."""
        from node.rl.parallel.state import gather_tensors

        return {n: t.clone() for n, t in gather_tensors(self.model, self.groups, lambda p: p.grad)}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        from node.rl.parallel.state import gather_tensors

        return {n: t.clone() for n, t in gather_tensors(self.model, self.groups)}
