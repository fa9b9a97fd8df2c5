"""Sequences of different lengths in one forward: right padding, groups bounded in padded tokens, and groups of
sequences packed end to end bounded in tokens.

Right padding is exact under causal attention: a real position never attends to the padding after it.
Every batched prefill (the engines', the validator's recomputation) pads and groups with these (a GPU
validator packs instead, `packed_groups`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def right_pad(rows: Sequence[Sequence[int]], fill: int = 0) -> torch.Tensor:
    """[len(rows), longest] int64 token ids on the CPU, each row right-padded with `fill`."""
    out = torch.full((len(rows), max(len(r) for r in rows)), fill, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out


def token_budget_groups(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` sorted by length (ties in order), cut into runs whose padded size
    (members x the longest member) stays within `budget`; a sequence longer than the budget
    forms a group of its own."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[i] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


GROUP_OVERHEAD_TOKENS = 2048
"""What one more forward of a group is taken to cost beyond its padded tokens, in tokens (`padded_groups`, for the
trainer's micro-batches and the validator's recomputation): on the H200 the 5.2B trainer's forward + backward
cost ~21 us a padded token (benchmarks.trainer_profile, session 15), so this is ~40 ms a micro-batch, an
assumption (the kernels' fixed cost, not measured): on that benchmark's long-tailed batch, 4 micro-batches of
37.4k padded positions instead of 3 of 47.5k (1024 would make 7 of 32.7k). Measured on the H200 (session 18):
the validator's no-grad prefill 0.251 -> 0.207 s (1.21x, benchmarks.prefill_grouping) and the trainer's no-grad
pass 0.36 -> 0.23 s; but the trainer's forward/backward slower (a step 2.95 -> 3.60 s), so a trainer on a GPU
takes the fewest micro-batches there (`TrainerConfig.micro_batch_overhead_tokens` "auto")."""


def packed_groups(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices in order, cut into runs of at most `budget` tokens in all (a longer sequence alone): groups of
    sequences laid end to end (node/model/packed.py), where no member pads another, so order costs nothing."""
    groups: list[list[int]] = [[]]
    total = 0
    for i, n in enumerate(lengths):
        if groups[-1] and total + n > budget:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return [g for g in groups if g]


def padded_groups(lengths: Sequence[int], budget: int, overhead: int) -> list[list[int]]:
    """Indices of `lengths` sorted by length (ties in order), cut into runs whose padded size (members x the
    longest member) stays within `budget` (a sequence longer than that alone), where the cuts minimise the
    padded tokens plus `overhead` tokens per run (what one more forward costs beyond its tokens). Greedy
    filling (`token_budget_groups`) makes the fewest runs but pads short sequences up to long ones in the run
    where the lengths jump: on a long-tailed RL batch (`benchmarks.trainer_profile`'s, 256 rows) 47.5k padded
    positions for 29.3k real tokens in 3 runs, against 37.4k in 4 (35.6k in 5). Exact (dynamic programming
    over the sorted lengths: each run ends where the cost of the runs before it plus its own is least)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    sorted_len = np.array([max(1, lengths[i]) for i in order], dtype=np.int64)
    best = np.zeros(n + 1, dtype=np.float64)  # best[j]: least cost of the first j sorted sequences
    start = np.zeros(n + 1, dtype=np.int64)  # where the last run of that best split starts
    for j in range(1, n + 1):
        longest = int(sorted_len[j - 1])
        first = max(0, j - max(1, budget // longest))  # the most members a run ending here may hold
        cost = best[first:j] + (j - np.arange(first, j)) * longest + overhead
        k = int(np.argmin(cost))  # the first minimum: the longest such run
        best[j], start[j] = cost[k], first + k
    groups, j = [], n
    while j > 0:
        groups.append(order[start[j]:j])
        j = int(start[j])
    return groups[::-1]
