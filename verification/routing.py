"""The routing check: the experts a rollout claims its positions were routed to (router replay) are
the ones the claimed policy version routes them to.

The validator's recomputation prefill already runs every MoE layer under the claimed version, so
the check costs a comparison: per (position, MoE layer), is the claimed top-k set the recomputed
one (order inside the set does not matter)? A rollout is rejected when the share of pairs whose
sets differ exceeds `MAX_ROUTE_MISMATCH_SHARE` for the run's engine precision. Those shares bound
honest variation measured by `python -m benchmarks.route_calibration` (routing.json next to
it): engines at batch 1..32, KV-cached decode against the validator's full prefill, 1 and 2
threads. Routes the trainer would replay steer its gradient, so a node must not choose them.

Positions are those of the prefill, prompt + completion - 1 of them; the version of position p is
the version of the completion token it produced (the prompt belongs to the first token's version),
as for the other checks. In a multi-turn rollout whose version changed between turns, a tool
reply's positions were routed by the next turn's prefill, under that turn's version, while the
recomputation runs them under the reply's label version: such positions are not compared.
"""

from __future__ import annotations

import torch

from verification.checks import Failure, Reason
from verification.claim import RolloutClaim

MAX_ROUTE_MISMATCH_SHARE = {
    # CPU float32 engines routed every position exactly as the validator's prefill (honest maximum 0
    # over 768 rollouts, routing.json); the allowance (about one pair in 50) is for kernels the CPU
    # calibration could not measure (GPU), as the float32 hidden-state thresholds leave.
    "float32": 0.02,
    # bfloat16 engine vs bfloat16 prefill: honest maximum 0.0233 per rollout (routing.json); ~2x.
    "bfloat16": 0.05,
}
"""Largest share of (position, MoE layer) pairs of one rollout whose claimed top-k set may differ
from the recomputed one, per engine precision."""


def route_positions(claim: RolloutClaim) -> int:
    """Positions a claim's routes cover: every token fed to the model (the last one never is)."""
    return len(claim.prompt_ids) + len(claim.token_ids) - 1


def comparable(claim: RolloutClaim) -> torch.Tensor:
    """[positions] bool: positions whose engine pass ran the version the recomputation runs them
    under. False only at tool-reply positions of a multi-turn rollout whose version changed between
    its turns (see the module docstring)."""
    base = len(claim.prompt_ids) - 1
    mask = claim.sampled_mask
    label = [claim.versions[max(0, p - base)] for p in range(route_positions(claim))]
    # the version that computed position p: that of the first sampled token at or after p + 1
    ran, nxt = [0] * len(claim.token_ids), claim.versions[-1]
    for i in range(len(claim.token_ids) - 1, -1, -1):
        if mask[i]:
            nxt = claim.versions[i]
        ran[i] = nxt
    return torch.tensor([label[p] == ran[max(0, p - base)] for p in range(len(label))], dtype=torch.bool)


def mismatched_pairs(claimed: torch.Tensor, recomputed: torch.Tensor) -> torch.Tensor:
    """[positions, layers] bool: the claimed top-k set differs from the recomputed one."""
    return (claimed.sort(dim=-1).values != recomputed.to(claimed.dtype).sort(dim=-1).values).any(dim=-1)


def check_routes(claim: RolloutClaim, claimed: torch.Tensor, recomputed: torch.Tensor,
                 precision: str) -> Failure | None:
    """Claimed routes [positions, L, k] against the validator's recomputation of the same positions,
    each position under its own version (a mixed-version rollout's segments come from their own)."""
    if recomputed is None or claimed.shape != recomputed.shape:
        got = None if recomputed is None else tuple(recomputed.shape)
        return Failure(Reason.ROUTES_MALFORMED, f"routes of shape {tuple(claimed.shape)}, the model routes {got}")
    keep = comparable(claim)
    bad = mismatched_pairs(claimed[keep], recomputed[keep])
    share = float(bad.float().mean()) if bad.numel() else 0.0
    limit = MAX_ROUTE_MISMATCH_SHARE[precision]
    if share > limit:
        first = int(keep.nonzero()[int(bad.any(dim=-1).nonzero()[0])])
        return Failure(Reason.ROUTES_MISMATCH, f"{int(bad.sum())} of {bad.numel()} (position, layer) expert "
                       f"sets differ from the recomputation ({share:.3f} > {limit}); first at position {first}",
                       token=max(0, first - (len(claim.prompt_ids) - 1)))
    return None
