"""Group-relative advantages (GRPO-style): each sample is judged against its siblings."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, normalize_std: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, n] (n samples of each of G prompts) -> advantages [G, n]: reward minus the
    group mean, optionally divided by the group std. A group whose samples all scored the same
    carries no signal and gets zero advantage."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards.shape)}")
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (rewards.std(dim=1, keepdim=True) + eps)
    return adv
