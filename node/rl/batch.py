"""Training batches from rollouts: padded token tensors, loss masks, inference logprobs, advantages; cut into
micro-batches for the trainer's forwards, right-padded rows or sequences packed end to end in one row."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from node.envs.rollout import Rollout
from node.model.batching import GROUP_OVERHEAD_TOKENS, packed_groups, padded_groups, token_budget_groups


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, T]: (prompt + completion)[:-1]
    targets: torch.Tensor  # [B, T]: (prompt + completion)[1:]
    loss_mask: torch.Tensor  # [B, T] bool: target is a model token
    inference_logprobs: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B, T] (the sequence's advantage on every token)
    routed_experts: torch.Tensor | None  # [B, T, n_moe_layers, k] for router replay
    packed: tuple[int, ...] | None = None
    """Where the batch is one row [1, N] of sequences end to end: their lengths, in order (the model attends
    within each, `node.model.packed.Packed`; `pack_rows`); None: a row a sequence, right-padded."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def sequences(self) -> int:
        """Its sequences: its rows, or those packed in its one row."""
        return len(self) if self.packed is None else len(self.packed)

    def select(self, rows: torch.Tensor) -> "TrainBatch":
        self._rows_only("select")
        return TrainBatch(self.input_ids[rows], self.targets[rows], self.loss_mask[rows],
                          self.inference_logprobs[rows], self.advantages[rows],
                          None if self.routed_experts is None else self.routed_experts[rows])

    def columns(self, n: int) -> "TrainBatch":
        """The first `n` positions of every row (right padding beyond them: causal, so the same logprobs)."""
        self._rows_only("columns")
        return TrainBatch(self.input_ids[:, :n], self.targets[:, :n], self.loss_mask[:, :n],
                          self.inference_logprobs[:, :n], self.advantages[:, :n],
                          None if self.routed_experts is None else self.routed_experts[:, :n])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "TrainBatch":
        """The batch on `device` (the trainer's model's), built on the host from the rollouts. `non_blocking`
        from pinned host memory (`pinned`): the copy is queued behind the GPU's work instead of waiting for it
        (a copy from pageable memory waits for the stream)."""
        return TrainBatch(*(x.to(device, non_blocking=non_blocking) for x in (
            self.input_ids, self.targets, self.loss_mask, self.inference_logprobs, self.advantages)),
            None if self.routed_experts is None else self.routed_experts.to(device, non_blocking=non_blocking),
            self.packed)

    def pinned(self) -> "TrainBatch":
        """The batch in page-locked host memory (needs CUDA)."""
        return TrainBatch(*(x.pin_memory() for x in (self.input_ids, self.targets, self.loss_mask,
                                                     self.inference_logprobs, self.advantages)),
                          None if self.routed_experts is None else self.routed_experts.pin_memory(), self.packed)

    def _rows_only(self, what: str) -> None:
        if self.packed is not None:
            raise ValueError(f"{what} takes a batch of a row a sequence, not {len(self.packed)} sequences packed in one")


def build_batch(rollouts: list[Rollout], advantages: list[float], pad_id: int = 0) -> TrainBatch:
    if len(rollouts) != len(advantages) or not rollouts:
        raise ValueError("need one advantage per rollout and at least one rollout")
    t = max(len(r.prompt_ids) + len(r.completion_ids) - 1 for r in rollouts)
    b = len(rollouts)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    targets = torch.full((b, t), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(b, t, dtype=torch.bool)
    logprobs = torch.zeros(b, t)
    adv = torch.zeros(b, t)
    experts = None
    if all(r.routed_experts is not None for r in rollouts):
        shape = rollouts[0].routed_experts.shape[1:]
        # in the rollouts' own dtype (the trainer role's are compact: `compact_routes_dtype`), or one that holds all
        dtype = functools.reduce(torch.promote_types, {r.routed_experts.dtype for r in rollouts})
        experts = torch.zeros(b, t, *shape, dtype=dtype)
    for i, (r, a) in enumerate(zip(rollouts, advantages)):
        seq = torch.tensor(r.prompt_ids + r.completion_ids)
        n, p = len(seq) - 1, len(r.prompt_ids)
        input_ids[i, :n], targets[i, :n] = seq[:-1], seq[1:]
        loss_mask[i, p - 1 : n] = torch.tensor(r.loss_mask, dtype=torch.bool)
        logprobs[i, p - 1 : n] = torch.tensor(r.logprobs)
        adv[i, :n] = a
        if experts is not None:
            experts[i, :n] = r.routed_experts[:n]
    return TrainBatch(input_ids, targets, loss_mask, logprobs, adv, experts)


def loss_rows(batch: TrainBatch) -> torch.Tensor:
    """Flat indices (row x positions + position, int64, on the mask's device) of the positions `batch` takes loss
    at, in order: the only ones whose logits the trainer computes (`Trainer.logprobs`)."""
    return batch.loss_mask.reshape(-1).nonzero().squeeze(-1)


def micro_batches(batch: TrainBatch, tokens: int, overhead: int | None = GROUP_OVERHEAD_TOKENS,
                  pack: bool = False) -> list[TrainBatch]:
    """The pieces one forward/backward takes at a time, each row cut after its last loss position. Padded: `batch`
    itself when its padded tokens (rows x positions) fit `tokens`; else its rows in groups of similar length whose
    padded tokens stay within `tokens` (a row longer than that alone), chosen to pad least for `overhead` tokens a
    group (`node.model.batching.padded_groups`; None: the fewest groups). `pack`: its rows end to end in runs of
    at most `tokens` tokens (`node.model.batching.packed_groups`, a longer row alone), one packed row each (`pack_rows`):
    no padding at all (on a long-tailed RL batch most of a padded one's positions)."""
    b, t = batch.input_ids.shape
    if b * t <= tokens and not pack:
        return [batch]
    lengths = row_lengths(batch)
    if pack:
        return [pack_rows(batch, rows, lengths) for rows in packed_groups(lengths, tokens)]
    groups = token_budget_groups(lengths, tokens) if overhead is None else padded_groups(lengths, tokens, overhead)
    return [batch.select(torch.tensor(rows)).columns(max(lengths[i] for i in rows)) for rows in groups]


def row_lengths(batch: TrainBatch) -> list[int]:
    """Each row's positions up to its last loss position (at least 1): what a forward of it needs (causal)."""
    t = batch.input_ids.shape[1]
    last = torch.where(batch.loss_mask, torch.arange(t, device=batch.loss_mask.device), -1).max(dim=1).values
    return (last + 1).clamp(min=1).tolist()


def pack_rows(batch: TrainBatch, rows: list[int], lengths: list[int]) -> TrainBatch:
    """`batch`'s `rows`, each its first `lengths[row]` positions, end to end in one row [1, N] (`TrainBatch.packed`)."""
    pick = batch.select(torch.tensor(rows))
    n = torch.tensor([lengths[r] for r in rows], device=batch.input_ids.device)
    keep = torch.arange(pick.input_ids.shape[1], device=n.device)[None] < n[:, None]  # row-major: rows in order
    flat = [x[keep][None] for x in (pick.input_ids, pick.targets, pick.loss_mask, pick.inference_logprobs,
                                    pick.advantages)]
    experts = None if pick.routed_experts is None else pick.routed_experts[keep][None]
    return TrainBatch(*flat, experts, tuple(lengths[r] for r in rows))
