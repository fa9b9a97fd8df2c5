"""Sequences of different lengths in one forward: right padding, and groups bounded in padded tokens.

Right padding is exact under causal attention: a real position never attends to the padding after it.
Every batched prefill (the engines', the validator's recomputation) pads and groups with these two.
"""

from __future__ import annotations

from collections.abc import Sequence

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
