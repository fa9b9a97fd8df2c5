"""The routing check's vectorised parts against the rules as first written, on random claims: which positions
are compared (`comparable`), and each claim's evidence counted from running sums over a round's pairs
(`check_routes_many`) rather than two sums a claim."""

import random

import torch

from verification.claim import RolloutClaim
from verification.routing import (ROUTER_TIE, _judge_routes, check_routes_many, comparable, mismatched_pairs,
                                  set_gap)


def _per_position(claim: RolloutClaim) -> torch.Tensor:
    """The rule as first written, one position at a time."""
    base = len(claim.prompt_ids) - 1
    mask = claim.sampled_mask
    positions = len(claim.prompt_ids) + len(claim.token_ids) - 1
    label = [claim.versions[max(0, p - base)] for p in range(positions)]
    ran, nxt = [0] * len(claim.token_ids), claim.versions[-1]
    for i in range(len(claim.token_ids) - 1, -1, -1):
        if mask[i]:
            nxt = claim.versions[i]
        ran[i] = nxt
    return torch.tensor([label[p] == ran[max(0, p - base)] for p in range(len(label))], dtype=torch.bool)


def _random_claim(rng: random.Random) -> RolloutClaim:
    n = rng.randrange(1, 30)
    versions, v = [], rng.randrange(3)
    for _ in range(n):
        v += rng.random() < 0.15
        versions.append(v)
    sampled = rng.choice([None, [True] * n, [rng.random() < 0.6 for _ in range(n)]])
    return RolloutClaim.model_construct(prompt_ids=[1] * rng.randrange(1, 6), token_ids=[2] * n,
                                        versions=versions, sampled=sampled)


def _per_claim(items: list, precision: str, forced: bool) -> list:
    """`check_routes_many` as first written (items of one kind: all with router logits or none): two sums a claim."""
    keeps = [_per_position(c) for c, *_ in items]

    def kept(col: int) -> torch.Tensor:
        return torch.cat([it[col] if bool(k.all()) else it[col][k] for it, k in zip(items, keeps)])

    claimed = kept(1)
    if items[0][3] is not None:
        logits = kept(3).float()
        own = logits.topk(claimed.shape[-1], dim=-1).indices if forced else kept(2)
        bad = mismatched_pairs(claimed, own)
        near = set_gap(claimed, logits) >= -ROUTER_TIE[precision]
        flags = torch.stack([bad & ~near, bad & near])
    else:
        bad = mismatched_pairs(claimed, kept(2))
        flags = torch.stack([bad, torch.zeros_like(bad)])
    out, row = [], 0
    for (c, *_), keep in zip(items, keeps):
        rows = int(keep.sum())
        out.append(_judge_routes(c, keep, flags[0, row : row + rows], int(flags[1, row : row + rows].sum()), precision))
        row += rows
    return out


def test_compared_positions_are_those_the_per_position_rule_compares():
    rng = random.Random(0)
    seen_false = 0
    for _ in range(500):
        claim = _random_claim(rng)
        got, want = comparable(claim), _per_position(claim)
        assert got.dtype == torch.bool and torch.equal(got, want), (versions, sampled)
        seen_false += int((~want).sum()) > 0
    assert seen_false > 20  # the random claims reach the rule's False positions, not only its fast path


def test_route_evidence_counted_from_running_sums_is_each_claims_own_count():
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    layers, k, experts = 3, 2, 6
    failed = 0
    for trial in range(60):
        precision, forced, with_logits = rng.choice(["float32", "bfloat16"]), rng.random() < 0.5, rng.random() < 0.7
        items = []
        for _ in range(rng.randrange(1, 10)):
            claim = _random_claim(rng)
            positions = len(claim.prompt_ids) + len(claim.token_ids) - 1
            router = torch.randn(positions, layers, experts, generator=gen)
            routes = router.topk(k, dim=-1).indices
            claimed = routes.clone()
            forged = torch.rand(positions, layers, generator=gen) < rng.choice([0.0, 0.05, 0.3])
            claimed[forged] = torch.randint(0, experts, (int(forged.sum()), k), generator=gen).sort(-1).values
            items.append((claim, claimed, routes, router if with_logits else None))
        got = check_routes_many(items, precision, forced=forced)
        want = _per_claim(items, precision, forced)
        assert [(f is None) or (f.reason, f.severity, f.token, f.detail) for f in got] == \
            [(f is None) or (f.reason, f.severity, f.token, f.detail) for f in want]
        failed += sum(f is not None for f in want)
    assert failed > 10  # the random claims reach the binomial test's rejections, not only passes
