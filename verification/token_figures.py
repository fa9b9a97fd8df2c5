"""The per-token figures the recomputation checks judge a segment by, for many segments at once.

Invariant: each segment's figures are exactly those computed from its own tokens alone (`of_one`, the
rule `verification.checks` applied segment by segment): every figure is elementwise (the logprob error
of a token, its sampling flag) or an exact reduction of them (a count, a maximum), so computing them
over the concatenation of all segments changes no bit. One pass of a few tensor operations replaces
about twenty per segment, which at a round of 128 claims was most of the checks' host time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenFigures:
    """One segment's tokens as measured: views into the batch's tensors, and its per-segment reductions."""

    claimed_lp: torch.Tensor
    """float32 [n]: the logprobs the claim states."""
    ours: torch.Tensor
    """[n]: the recomputed logprobs of the claimed tokens."""
    err: torch.Tensor
    """float32 [n]: |claimed - recomputed|, NaN as inf."""
    claimed_tok: torch.Tensor
    """long [n]: the claimed tokens."""
    sampling_bad: torch.Tensor
    """bool [n]: the seeded replay chose another token, beyond `margin_noise`."""
    over: int
    """Tokens whose `err` exceeds the per-token bound."""
    worst: float
    """The largest `err` (the first of equals is the one a failure names: `err.argmax()`)."""
    any_sampling_bad: bool
    """Whether any `sampling_bad` holds."""


def picked(values: list, idx: list[int]) -> list:
    """values[i] for i in idx (ascending and distinct, as a segment's tokens are): a slice where they are one run
    (a single-turn, single-version rollout's), not a Python step per token."""
    if idx and idx[-1] - idx[0] + 1 == len(idx):
        return values[idx[0] : idx[-1] + 1]
    return [values[i] for i in idx]


def positions(prompt_len: int, idx: list[int]) -> list[int]:
    """The absolute positions of completion tokens idx (ascending and distinct) after a prompt of prompt_len."""
    if idx and idx[-1] - idx[0] + 1 == len(idx):
        return list(range(prompt_len + idx[0], prompt_len + idx[-1] + 1))
    return [prompt_len + i for i in idx]


def of_segments(claimed_tok: list[list[int]], claimed_lp: list[list[float]], ours: list[torch.Tensor],
                replayed_tok: list[torch.Tensor], margins: list[torch.Tensor], max_logprob_err: float,
                margin_noise: float) -> list[TokenFigures]:
    """`of_one` of every segment i (its claimed tokens and logprobs, the host tensors its measurement gave),
    computed over all their tokens together."""
    lens = [len(c) for c in claimed_tok]
    if sum(lens) == 0:
        return [of_one(*args, max_logprob_err, margin_noise)
                for args in zip(claimed_tok, claimed_lp, ours, replayed_tok, margins)]
    tok = torch.tensor([t for c in claimed_tok for t in c])
    lp = torch.tensor([x for c in claimed_lp for x in c], dtype=torch.float32)
    ours_all = torch.cat(ours)
    err = (lp - ours_all).abs().nan_to_num(nan=float("inf"))
    bad = (torch.cat(replayed_tok) != tok) & (torch.cat(margins) > margin_noise)
    segment = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    over = torch.zeros(len(lens), dtype=torch.long).index_add_(0, segment, (err > max_logprob_err).long())
    # err >= 0 (an absolute value, inf for NaN): -1 is below every error, so an empty segment's maximum stays -1
    worst = torch.full((len(lens),), -1.0, dtype=err.dtype).scatter_reduce_(0, segment, err, "amax")
    n_bad = torch.zeros(len(lens), dtype=torch.long).index_add_(0, segment, bad.long())
    out, k = [], 0
    for n, o, w, b in zip(lens, over.tolist(), worst.tolist(), n_bad.tolist()):
        out.append(TokenFigures(lp[k : k + n], ours_all[k : k + n], err[k : k + n], tok[k : k + n], bad[k : k + n],
                                o, w, b > 0))
        k += n
    return out


def of_one(claimed_tok: list[int], claimed_lp: list[float], ours: torch.Tensor, replayed_tok: torch.Tensor,
           margins: torch.Tensor, max_logprob_err: float, margin_noise: float) -> TokenFigures:
    """One segment's figures from its tokens alone (the rule `of_segments` keeps bit for bit)."""
    tok = torch.tensor(claimed_tok, dtype=torch.long)
    lp = torch.tensor(claimed_lp, dtype=torch.float32)
    err = (lp - ours).abs().nan_to_num(nan=float("inf"))
    bad = (replayed_tok != tok) & (margins > margin_noise)
    worst = float(err[int(err.argmax())]) if len(err) else -1.0
    return TokenFigures(lp, ours, err, tok, bad, int((err > max_logprob_err).sum()), worst, bool(bad.any()))
