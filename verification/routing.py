"""The routing check: the experts a rollout claims its positions were routed to (router replay) are
the ones the claimed policy version routes them to.

The validator's recomputation prefill already runs every MoE layer under the claimed version, so
the check costs a comparison per (position, MoE layer) pair: is the claimed top-k set (order inside
the set does not matter) one the recomputed router logits could have chosen? Routes the trainer
would replay steer its gradient, so a node must not choose them.

Near-ties are not evidence. An honest engine's router logits differ from the validator's by at most
delta per entry (decode with a KV cache vs one prefill, batch shape, threads, precision), so its
top-k set S satisfies min_{e in S} l_e >= max_{e not in S} l_e - 2 delta in the validator's logits
l. A differing pair whose claimed set meets that bound with `ROUTER_TIE[precision]` >= 2 delta is a
near-tie and does not count; only the others (`evidence`) do. Without router logits (a Reference
that cannot return them) every differing pair counts.

The decision is a binomial test with a stated false-positive rate: honest evidence pairs are
modelled as independent with rate at most `HONEST_PAIR_RATE[precision]` (above the raw rate of ALL
differing honest pairs, near-ties included, that calibration measured); a rollout is rejected when
P(Binomial(n, p0) >= evidence) < `FALSE_REJECT_RATE`, n its compared pairs. So one or two differing
pairs in a 20-pair rollout never reject (3 are needed in float32, 4 in bf16), and a long rollout needs a share well under
1%. A rejection with at least `PROOF_FACTOR` times the needed evidence is proof-grade; closer to the
line it is borderline (`Severity`), which a coordinator counts as a strike rather than a ban.

Positions are those of the prefill, prompt + completion - 1 of them; the version of position p is
the version of the completion token it produced (the prompt belongs to the first token's version),
as for the other checks. In a multi-turn rollout whose version changed between turns, a tool
reply's positions were routed by the next turn's prefill, under that turn's version, while the
recomputation runs them under the reply's label version: such positions are not compared.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from verification.checks import PROOF_FACTOR, Failure, Reason, Severity
from verification.claim import RolloutClaim

ROUTER_TIE = {
    # CPU float32: decode-with-cache vs prefill router logits differed by at most 1.4e-6 (tiny MoE,
    # batch 8, 1 and 2 threads: benchmarks/results/weak_tamper-cpu-2core.json `honest.router_logit_spread`);
    # 1e-3 leaves room for GPU float32 kernels (TF32 matmuls round to ~1e-3 relative).
    "float32": 1e-3,
    # bf16: at most 0.0156 (2 ulps at |logit| ~2); 2 delta = 0.031, doubled.
    "bfloat16": 0.0625,
    # FP8 runs (engine and validator quantised alike; the gate itself stays in the base dtype): decode vs
    # prefill router logits differed by at most 5.1e-4 / 0.0082 (float32 base, experts / all) and 0.035 /
    # 0.059 (bf16 base), 1 and 2 threads (verification/calibration/routing-fp8.json `router_logit_spread`,
    # CPU reference GEMM only); 2 delta, doubled, as for bf16.
    "fp8-experts-float32": 0.0025,
    "fp8-all-float32": 0.035,
    "fp8-experts-bfloat16": 0.15,
    "fp8-all-bfloat16": 0.25,
}
"""A differing (position, layer) pair whose claimed set is within this much (router logit units) of
being the recomputed top-k is a near-tie, not evidence."""

HONEST_PAIR_RATE = {
    # CPU float32: 0 differing pairs of 55,176 honest ones, near-ties included (verification/calibration/
    # routing.json; 95% upper bound 5.4e-5); about twice that bound, with near-ties (1e-3, ~700x the
    # CPU spread) not counted.
    "float32": 1e-4,
    # bf16: 88 differing pairs of 55,232 (1.6e-3), near-ties included; the bound covers them all.
    "bfloat16": 2e-3,
    # FP8 runs (verification/calibration/routing-fp8.json: `route_calibration --fp8 --batched-only --rollouts
    # 24`, engine batch 1/8/32 x 1/2 threads, CPU reference GEMM only; the differing pairs were the same in
    # every engine variation: KV-cached decode against prefill). float32 base: 0 differing pairs of 10,908
    # (experts) and 10,368 (all): the float32 bound.
    "fp8-experts-float32": 1e-4,
    "fp8-all-float32": 1e-4,
    # bf16 base, experts: 18 of 10,524 (1.7e-3), near-ties included: the bf16 bound covers them.
    "fp8-experts-bfloat16": 2e-3,
    # bf16 base, all: 40 of 10,380 (3.9e-3), at most 7 of 1,730 in one variation (4.0e-3): above the bf16 bound: 5e-3.
    "fp8-all-bfloat16": 5e-3,
}
"""Upper bound on the per-pair rate at which an honest engine's routes count as evidence."""

FALSE_REJECT_RATE = 1e-7
"""Per honest rollout, the chance the binomial test rejects it (under the model above): at most
0.01 expected false rejections per 100,000 honest rollouts."""


def route_positions(claim: RolloutClaim) -> int:
    """Positions a claim's routes cover: every token fed to the model (the last one never is)."""
    return len(claim.prompt_ids) + len(claim.token_ids) - 1


def comparable(claim: RolloutClaim) -> torch.Tensor:
    """[positions] bool: positions whose engine pass ran the version the recomputation runs them
    under. False only at tool-reply positions of a multi-turn rollout whose version changed between
    its turns (see the module docstring)."""
    mask = _incomparable(claim)
    return torch.ones(route_positions(claim), dtype=torch.bool) if mask is None else torch.from_numpy(mask)


def _incomparable(claim: RolloutClaim) -> np.ndarray | None:
    """`comparable`'s mask, None where every position is comparable (a rollout of one version, or with no
    tool tokens: what nearly every claim is, told without a pass over its positions)."""
    versions = claim.versions
    if claim.sampled is None or all(claim.sampled) or versions.count(versions[0]) == len(versions):
        return None
    # position p was labelled with the version of completion token j = max(0, p - base) and computed by the
    # version of the first sampled token at or after j (the last token's, after the last sampled one)
    v = np.asarray(versions)
    sampled = np.flatnonzero(np.asarray(claim.sampled))
    after = np.searchsorted(sampled, np.arange(len(v)))
    ran = np.where(after < len(sampled), v[sampled[np.minimum(after, len(sampled) - 1)]], v[-1]) if len(sampled) \
        else np.full(len(v), v[-1])
    base = len(claim.prompt_ids) - 1
    return (v == ran)[np.maximum(0, np.arange(route_positions(claim)) - base)]


def mismatched_pairs(claimed: torch.Tensor, recomputed: torch.Tensor) -> torch.Tensor:
    """[positions, layers] bool: the claimed top-k set differs from the recomputed one."""
    return (claimed.sort(dim=-1).values != recomputed.to(claimed.dtype).sort(dim=-1).values).any(dim=-1)


def set_gap(claimed: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """[positions, layers]: min logit of the claimed experts minus max logit of the others. >= 0
    exactly when the claimed set is a top-k of these logits; slightly negative at a near-tie."""
    chosen = router_logits.gather(-1, claimed.long())
    others = router_logits.scatter(-1, claimed.long(), float("-inf"))
    return chosen.min(dim=-1).values - others.max(dim=-1).values


@lru_cache(maxsize=4096)
def evidence_needed(pairs: int, rate: float, alpha: float = FALSE_REJECT_RATE) -> int:
    """Smallest m with P(Binomial(pairs, rate) >= m) < alpha (pairs + 1 when none: never reject)."""
    if pairs <= 0:
        return 1
    log_q, tail = math.log1p(-rate), 1.0
    for m in range(pairs + 1):
        if tail < alpha:
            return m
        # P(X = m), subtracted to get P(X >= m + 1)
        log_pm = (math.lgamma(pairs + 1) - math.lgamma(m + 1) - math.lgamma(pairs - m + 1)
                  + m * math.log(rate) + (pairs - m) * log_q)
        tail -= math.exp(log_pm)
    return pairs + 1


def check_routes(claim: RolloutClaim, claimed: torch.Tensor, recomputed: torch.Tensor, precision: str,
                 router_logits: torch.Tensor | None = None) -> Failure | None:
    """Claimed routes [positions, L, k] against the validator's recomputation of the same positions,
    each position under its own version (a mixed-version rollout's segments come from their own);
    `router_logits` [positions, L, E]: the recomputation's, to tell near-ties apart."""
    return check_routes_many([(claim, claimed, recomputed, router_logits)], precision)[0]


def check_routes_many(items: list[tuple[RolloutClaim, torch.Tensor, torch.Tensor | None, torch.Tensor | None]],
                      precision: str, forced: bool = False) -> list[Failure | None]:
    """`check_routes` of many (claim, claimed, recomputed, router logits) at once: the comparisons of all of
    them in one pass where the recomputation is (a GPU validator's router logits stay on its GPU), one
    transfer of per-pair flags back, then each claim's binomial test alone. `forced`: the recomputation ran
    along the claimed routes, so its own choice at a pair is the top-k of its router logits there (the
    recomputed routes are the claimed ones; a claim without router logits is compared with those)."""
    out: list[Failure | None] = [None] * len(items)
    groups: dict[bool, list[int]] = {}  # with usable router logits or not: compared in one pass each
    for n, (claim, claimed, recomputed, logits) in enumerate(items):
        if recomputed is None or claimed.shape != recomputed.shape:
            got = None if recomputed is None else tuple(recomputed.shape)
            out[n] = Failure(Reason.ROUTES_MALFORMED, f"routes of shape {tuple(claimed.shape)}, the model routes {got}")
            continue
        if forced and logits is not None and logits.shape[:2] != claimed.shape[:2]:
            out[n] = Failure(Reason.ROUTES_MALFORMED, f"routes of shape {tuple(claimed.shape)}, router logits of "
                             f"{tuple(logits.shape)}")
            continue
        groups.setdefault(logits is not None and logits.shape[:2] == claimed.shape[:2], []).append(n)
    for with_logits, members in groups.items():
        masks = [_incomparable(items[n][0]) for n in members]  # None: every position compared
        device = items[members[0]][3 if with_logits else 2].device  # where the router logits are: no copy of them

        def kept(col: int) -> torch.Tensor:
            return torch.cat([_kept(items[n][col], mask) for n, mask in zip(members, masks)]).to(device)

        claimed = kept(1)
        if with_logits:
            logits = kept(3).float()
            own = logits.topk(claimed.shape[-1], dim=-1).indices if forced else kept(2)
            bad = mismatched_pairs(claimed, own)
            near = set_gap(claimed, logits) >= -ROUTER_TIE[precision]
            flags = torch.stack([bad & ~near, bad & near]).cpu()
        else:
            own = kept(2)
            bad = mismatched_pairs(claimed, own)
            flags = torch.stack([bad, torch.zeros_like(bad)]).cpu()
        # each claim's (evidence, near-ties) from running sums over the positions: one pass, not two sums a claim
        total, layers = flags.shape[1], flags.shape[2]
        sums = torch.cat([torch.zeros(2, 1, dtype=torch.long), flags.sum(-1).cumsum(1)], 1).tolist()
        row = 0
        for n, mask in zip(members, masks):
            rows = route_positions(items[n][0]) if mask is None else int(mask.sum())
            a, b = min(row, total), min(row + rows, total)
            evidence, ties = sums[0][b] - sums[0][a], sums[1][b] - sums[1][a]
            # `_judge_routes` passes a claim short of the evidence needed: asked only of the others
            if evidence >= evidence_needed((b - a) * layers, HONEST_PAIR_RATE[precision]):
                out[n] = _judge_routes(items[n][0], comparable(items[n][0]), flags[0, a:b], ties, precision)
            row += rows
    return out


def _kept(x: torch.Tensor, mask: np.ndarray | None) -> torch.Tensor:
    """x's rows where the host mask holds (all of them, without indexing, where it is None: a boolean index
    on a GPU tensor waits for the device)."""
    return x if mask is None else x[torch.from_numpy(mask).to(x.device)]


def _judge_routes(claim: RolloutClaim, keep: torch.Tensor, bad: torch.Tensor, ties: int, precision: str) -> Failure | None:
    """One claim's binomial test on its compared pairs: `bad` [compared positions, L] counts as evidence."""
    n, evidence = bad.numel(), int(bad.sum())
    needed = evidence_needed(n, HONEST_PAIR_RATE[precision])
    if evidence < needed:
        return None
    first = int(keep.nonzero()[int(bad.any(dim=-1).nonzero()[0])])
    severity = Severity.PROOF if evidence >= PROOF_FACTOR * needed else Severity.BORDERLINE
    return Failure(Reason.ROUTES_MISMATCH, f"{evidence} of {n} (position, layer) expert sets differ from the "
                   f"recomputation beyond a near-tie ({ties} near-ties not counted; {needed} reject at "
                   f"false-positive rate {FALSE_REJECT_RATE:g}); first at position {first}",
                   token=max(0, first - (len(claim.prompt_ids) - 1)), severity=severity)
