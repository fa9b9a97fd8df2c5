"""Routed experts: the wire codec, and the validator's routing check (honest accepted, tampered rejected)."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import rollouts as R  # noqa: E402

from node.engine import Engine  # noqa: E402
from node.model.routing import InvalidRoutes, RouteShape, decode_routes, encode_routes, rollout_routes  # noqa: E402
from verification.calibration.perturb import perturb  # noqa: E402
from verification.checks import Reason  # noqa: E402
from verification.checks import Severity  # noqa: E402
from verification.routing import (HONEST_PAIR_RATE, ROUTER_TIE, check_routes, evidence_needed,  # noqa: E402
                                  set_gap)
from verification.validator import _segments, verify_claims  # noqa: E402

SEEDS = list(range(300, 316))


# ---- codec ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_experts, id_bytes", [(4, 1), (256, 1), (257, 2), (1024, 2)])
def test_routes_round_trip_in_one_or_two_bytes_per_expert_id(num_experts, id_bytes):
    shape = RouteShape(moe_layers=3, top_k=2, num_experts=num_experts)
    routes = torch.randint(0, num_experts, (11, 3, 2), generator=torch.Generator().manual_seed(num_experts))
    routes[0, 0] = torch.tensor([0, num_experts - 1])
    data = encode_routes(routes, shape)
    assert len(data) == 11 * 3 * 2 * id_bytes == shape.nbytes(11)
    assert torch.equal(decode_routes(data, 11, shape), routes)
    compact = decode_routes(data, 11, shape, compact=True)  # what the trainer role's batches hold
    assert compact.dtype == (torch.uint8 if id_bytes == 1 else torch.int16) and torch.equal(compact.long(), routes)
    if id_bytes == 2:  # little-endian on the wire whatever the host
        assert data[:4] == (0).to_bytes(2, "little") + (num_experts - 1).to_bytes(2, "little")


def test_route_bytes_of_a_wrong_length_or_expert_id_are_a_typed_error():
    shape = RouteShape(moe_layers=2, top_k=2, num_experts=4)
    data = encode_routes(torch.zeros(5, 2, 2, dtype=torch.long), shape)
    with pytest.raises(InvalidRoutes, match="expected 24"):
        decode_routes(data, 6, shape)
    with pytest.raises(InvalidRoutes):
        decode_routes(data[:-1], 5, shape)
    with pytest.raises(InvalidRoutes, match="outside"):
        decode_routes(data[:-1] + bytes([4]), 5, shape)
    wide = RouteShape(moe_layers=1, top_k=1, num_experts=300)
    with pytest.raises(InvalidRoutes, match="outside"):
        decode_routes((300).to_bytes(2, "little"), 1, wide)
    with pytest.raises(InvalidRoutes):
        encode_routes(torch.full((1, 2, 2), 4), shape)
    with pytest.raises(InvalidRoutes):
        encode_routes(torch.zeros(3, 2, 3, dtype=torch.long), shape)


def test_a_multi_turn_rollout_takes_each_position_from_the_pass_that_first_computed_it():
    first = torch.zeros(5, 1, 1, dtype=torch.long)  # turn 0: prompt 3 + 3 tokens - 1
    second = torch.ones(9, 1, 1, dtype=torch.long)  # turn 1 re-prefilled the first 5 positions
    routes = rollout_routes([first, second])
    assert routes.shape[0] == 9 and routes[:5].eq(0).all() and routes[5:].eq(1).all()
    assert rollout_routes([first, None]) is None


# ---- the validator's check -------------------------------------------------------------------------
def _claims_with_routes(model, work, engine_model=None):
    engine = Engine(engine_model or model, max_batch=8, max_seq_len=R.MAX_SEQ, eos_id=R.TOK.eos_id,
                    decode=R.TOK.decode, capture_hidden=True, capture_experts=True)
    comps = R.generate(engine, work)
    shape = RouteShape.of(model.config)
    return [c.model_copy(update={"routed_experts": encode_routes(comp.routed_experts, shape)})
            for c, comp in zip(R.claims_from(comps, work), comps)], comps


@pytest.fixture(scope="module")
def world():
    model = R.tiny_model()
    work = [(s, R.spec(s)) for s in SEEDS]
    claims, comps = _claims_with_routes(model, work)
    return model, R.reference({0: model}), work, claims, comps


def test_honest_routes_are_accepted(world):
    _, ref, _, claims, _ = world
    assert [v.reason for v in verify_claims(claims, ref)] == [Reason.OK] * len(claims)


def test_claims_without_routes_are_still_judged_on_the_rest(world):
    _, ref, _, claims, _ = world
    bare = [c.model_copy(update={"routed_experts": None}) for c in claims]
    assert all(v.accepted for v in verify_claims(bare, ref))


def _forge(comp, share: float, seed: int) -> torch.Tensor:
    """The honest routes with the given share of (position, layer) sets replaced by other experts."""
    routes = comp.routed_experts.clone()
    pos, layers, k = routes.shape
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(pos * layers, generator=g)[: max(1, round(share * pos * layers))]
    for flat in pick.tolist():
        p, layer = divmod(flat, layers)
        routes[p, layer] = (routes[p, layer] + 1 + torch.randint(0, 3, (1,), generator=g)) % 4
        if routes[p, layer, 0] == routes[p, layer, 1]:
            routes[p, layer, 1] = (routes[p, layer, 0] + 1) % 4
    return routes


def test_forged_routes_are_rejected_beside_accepted_honest_ones(world):
    model, ref, _, claims, comps = world
    shape = RouteShape.of(model.config)
    forged = [c.model_copy(update={"routed_experts": encode_routes(_forge(comp, 0.25, i), shape)})
              for i, (c, comp) in enumerate(zip(claims, comps))]
    verdicts = verify_claims(forged + claims, ref)
    # the validator recomputes along the claimed routes, so forged ones also move the hidden states
    # away from the engine's proofs: either check may be the one that says so
    assert {v.reason for v in verdicts[: len(forged)]} <= {Reason.ROUTES_MISMATCH, Reason.HIDDEN_MISMATCH,
                                                           Reason.LOGPROB_MISMATCH, Reason.SAMPLING_MISMATCH}
    assert not any(v.accepted for v in verdicts[: len(forged)])
    assert all(v.accepted for v in verdicts[len(forged):])
    assert sum(v.severity == Severity.PROOF for v in verdicts[: len(forged)]) >= len(forged) // 2
    assert all(v.severity == Severity.NONE for v in verdicts[len(forged):])
    # One forged pair is below what the binomial test needs (honest variation), in any rollout.
    light = _forge(comps[0], 0.0, 1)
    assert check_routes(claims[0], light, comps[0].routed_experts, ref.precision) is None


def test_routes_of_a_wrong_length_or_expert_id_are_rejected_as_malformed(world):
    _, ref, _, claims, _ = world
    c = claims[0]
    short = c.model_copy(update={"routed_experts": c.routed_experts[:-4]})
    out_of_range = c.model_copy(update={"routed_experts": bytes([9]) + c.routed_experts[1:]})
    verdicts = verify_claims([short, out_of_range, c], ref)
    assert [v.reason for v in verdicts] == [Reason.ROUTES_MALFORMED, Reason.ROUTES_MALFORMED, Reason.OK]


def test_routes_from_other_weights_are_rejected(world):
    model, ref, work, claims, _ = world
    # Routes computed by another model, pasted onto honest tokens, logprobs and proofs.
    other, _ = _claims_with_routes(model, work, perturb(model, "noise1pct", seed=3))
    swapped = [c.model_copy(update={"routed_experts": o.routed_experts}) for c, o in zip(claims, other)
               if len(c.routed_experts) == len(o.routed_experts) and c.routed_experts != o.routed_experts]
    verdicts = verify_claims(swapped, ref)
    # recomputed along the pasted routes, the hidden states leave the proofs too (either check may say so)
    assert swapped and sum(not v.accepted and v.reason in (Reason.ROUTES_MISMATCH, Reason.HIDDEN_MISMATCH)
                           for v in verdicts) >= len(swapped) // 2


def test_mixed_version_routes_are_checked_segment_by_segment(world):
    model, _, work, _, _ = world
    newer = perturb(model, "noise1pct", seed=7)
    ref = R.reference({0: model, 1: newer})
    engine = Engine(copy.deepcopy(model), max_batch=32, max_seq_len=R.MAX_SEQ, eos_id=R.TOK.eos_id,
                    decode=R.TOK.decode, capture_hidden=True, capture_experts=True)
    for s, sp in work:
        engine.add_request(R.request(s, sp))
    done = []
    for _ in range(8):
        done += engine.step()
    engine.load_weights({k: v.clone() for k, v in newer.state_dict().items()}, version=1)
    while engine.has_work():
        done += engine.step()
    done.sort(key=lambda c: int(c.request_id[1:]))
    shape = RouteShape.of(model.config)
    claims = [c.model_copy(update={"routed_experts": encode_routes(comp.routed_experts, shape)})
              for c, comp in zip(R.claims_from(done, work), done)]
    mixed = [i for i, c in enumerate(claims) if len(set(c.versions)) == 2]
    assert len(mixed) >= len(work) // 2
    assert all(v.accepted for v in verify_claims(claims, ref))
    # The version-1 segment's routes replaced by version 0's routing of the same positions: wrong there.
    v0 = ref.prefill(0, [claims[i].prompt_ids + claims[i].token_ids[:-1] for i in mixed], with_routes=True)
    stale = [claims[i].model_copy(update={"routed_experts": encode_routes(routes, shape)})
             for i, (_, _, routes) in zip(mixed, v0)]
    changed = [c for c, i in zip(stale, mixed) if c.routed_experts != claims[i].routed_experts]
    bad = [v for v in verify_claims(changed, ref) if not v.accepted]
    assert bad and all(v.reason in (Reason.ROUTES_MISMATCH, Reason.HIDDEN_MISMATCH, Reason.LOGPROB_MISMATCH,
                                    Reason.SAMPLING_MISMATCH) for v in bad), [v.reason for v in bad]
    # Either segment's routes forged (the other segment honest): rejected whenever the forged pairs
    # are more than the threshold's share of the rollout's (the share is rollout-wide).
    for segment in (0, 1):
        forged, expect = [], []
        for i in mixed:
            c, routes = claims[i], done[i].routed_experts.clone()
            first_v1 = len(c.prompt_ids) - 1 + c.versions.index(1)
            rows = list(range(first_v1) if segment == 0 else range(first_v1, routes.shape[0]))
            routes[rows] = _forge(done[i], 1.0, i)[rows]
            changed = (routes.sort(-1).values != done[i].routed_experts.sort(-1).values).any(-1)
            # evidence: changed pairs that are not a near-tie of each position's own version's logits
            _, _, _, router = ref.prefill_mixed(c.prompt_ids + c.token_ids[:-1], _segments(c), with_routes=True,
                                                  with_router_logits=True)
            evidence = int((changed & (set_gap(routes, router) < -ROUTER_TIE["float32"])).sum())
            expect.append(Reason.ROUTES_MISMATCH if evidence >= evidence_needed(changed.numel(),
                                                                                 HONEST_PAIR_RATE["float32"])
                          else Reason.OK)
            forged.append(c.model_copy(update={"routed_experts": encode_routes(routes, shape)}))
        # recomputed along the forged routes, the hidden states leave the proofs too: a forgery below
        # the routing threshold may be rejected by that check instead, one above it always is
        got = verify_claims(forged, ref)
        assert all(not v.accepted for v, e in zip(got, expect) if e == Reason.ROUTES_MISMATCH)
        assert expect.count(Reason.ROUTES_MISMATCH) >= len(mixed) // 2


# ---- statistics: short rollouts, near-ties, severity --------------------------------------------------
def _short(claim, positions: int):
    """The claim cut to `positions` prefill positions (prompt prefix + one completion token): the
    routing check reads only the layout, so this is a rollout of positions x layers pairs."""
    seq = claim.prompt_ids + claim.token_ids
    return claim.model_copy(update={"prompt_ids": seq[:positions], "token_ids": seq[positions : positions + 1],
                                    "versions": claim.versions[:1], "logprobs": claim.logprobs[:1], "sampled": None})


def _far_swap(routes: torch.Tensor, router: torch.Tensor, p: int, layer: int) -> None:
    """Replace the pair's top-k set with the k lowest-logit experts: as far from a tie as it gets."""
    k = routes.shape[-1]
    routes[p, layer] = router[p, layer].argsort()[:k]


def test_one_differing_pair_of_twenty_is_not_a_ban_and_three_far_ones_are_borderline(world):
    """The chaos case: 1 of 20 (position, layer) pairs differed; a share threshold of 0.02 banned an
    honest node. The binomial test needs 3 of 20 (float32) at false-positive rate 1e-7."""
    model, ref, _, claims, _ = world
    c = _short(claims[0], 10)
    _, _, routes, router = ref.prefill(0, [c.prompt_ids], with_routes=True, with_router_logits=True)[0]
    assert routes.shape[:2] == (10, 2) and evidence_needed(20, HONEST_PAIR_RATE["float32"]) == 3
    assert check_routes(c, routes.clone(), routes, "float32", router) is None
    forged = routes.clone()
    _far_swap(forged, router, 3, 1)
    assert check_routes(c, forged, routes, "float32", router) is None  # one pair, not a tie: still no evidence
    _far_swap(forged, router, 5, 0)
    assert check_routes(c, forged, routes, "float32", router) is None  # two
    _far_swap(forged, router, 7, 0)
    f = check_routes(c, forged, routes, "float32", router)
    assert f is not None and f.reason == Reason.ROUTES_MISMATCH and f.severity == Severity.BORDERLINE
    for p in (1, 2, 4):
        _far_swap(forged, router, p, 0)
    f = check_routes(c, forged, routes, "float32", router)
    assert f is not None and f.severity == Severity.PROOF  # 6 of 20: twice what the test needs


def _tied_model(model, eps: float):
    """The model with router rows of experts 2 and 3 equal up to `eps` in every MoE layer: every
    position has a (near-)tie between them, which another kernel may break the other way."""
    tied = copy.deepcopy(model)
    with torch.no_grad():
        for layer in tied.model.layers:
            gate = layer.mlp.gate.weight
            gate[3] = gate[2] + eps
    return tied


def test_near_ties_between_experts_are_not_evidence_and_far_differences_are(world):
    """An engine whose kernels break a router near-tie the other way than the validator's prefill
    (here: router rows of experts 2 and 3 apart by +-1e-6, opposite signs on the two sides) routes
    many pairs differently, and every later position with them: the validator recomputes along the
    claimed routes, so the rollout is accepted; moved to the set that is not tied, it is not."""
    model, _, work, _, _ = world
    ref = R.reference({0: _tied_model(model, -1e-6)})
    claims, comps = _claims_with_routes(model, work[:8], _tied_model(model, 1e-6))
    ours = ref.prefill(0, [c.prompt_ids + c.token_ids[:-1] for c in claims], with_routes=True)
    differ = sum(int((comp.routed_experts.sort(-1).values != o[2].sort(-1).values).any(-1).sum())
                 for comp, o in zip(comps, ours))
    assert differ >= 8 * 10  # many pairs differ from the validator's own routing, all on a near-tie
    assert all(v.accepted for v in verify_claims(claims, ref)), [v.detail for v in verify_claims(claims, ref)]
    shape = RouteShape.of(model.config)
    far = []
    for c, comp in zip(claims, comps):
        wrong = comp.routed_experts.clone()
        has2, has3 = (wrong == 2).any(-1), (wrong == 3).any(-1)
        flip = has2 ^ has3  # exactly one of the tied pair chosen: the complement set is not tied
        wrong[flip] = _other_set(comp.routed_experts[flip])
        far.append(c.model_copy(update={"routed_experts": encode_routes(wrong, shape)}))
    assert not any(v.accepted for v in verify_claims(far, ref))


def _other_set(sets: torch.Tensor) -> torch.Tensor:
    """For top-2 sets over 4 experts that hold exactly one of experts 2 and 3: the complement set."""
    out = torch.empty_like(sets)
    for i, s in enumerate(sets.tolist()):
        out[i] = torch.tensor(sorted(set(range(4)) - set(s)))
    return out


def test_route_checks_of_many_claims_together_are_each_claims_own(world):
    """`check_routes_many` (the validator's round: one pass over every claim's pairs) gives each claim the
    verdict `check_routes` gives it alone: honest routes pass, forged ones fail with the same evidence,
    shapes that do not match are malformed, and near-ties count as they do alone; forced or not."""
    from verification.routing import check_routes_many

    _, ref, _, claims, _ = world
    items = []
    for n, c in enumerate(claims[:8]):
        c = _short(c, 10 + n)
        _, _, routes, router = ref.prefill(0, [c.prompt_ids], with_routes=True, with_router_logits=True)[0]
        claimed = routes.clone()
        for p in range(n % 4 * 2):  # 0, 2, 4 or 6 pairs far from the router's choice
            _far_swap(claimed, router, p, p % 2)
        items.append((c, claimed, routes, router))
    items.append((items[0][0], items[0][1], items[0][2][:-1], items[0][3]))  # a shape the model does not route
    items.append((items[1][0], items[1][1], items[1][2], None))  # no router logits: every differing pair counts
    alone = [check_routes(c, claimed, routes, "float32", router) for c, claimed, routes, router in items]
    together = check_routes_many(items, "float32")
    assert [(f is None) or (f.reason, f.severity, f.token, f.detail) for f in together] == \
        [(f is None) or (f.reason, f.severity, f.token, f.detail) for f in alone]
    assert any(f is None for f in together) and any(f is not None and f.reason == Reason.ROUTES_MISMATCH for f in together)
    assert together[-2].reason == Reason.ROUTES_MALFORMED
    # forced (the recomputation ran along the claimed routes): the router's own top-k is what a claim meets
    forced = check_routes_many([(c, claimed, claimed, router) for c, claimed, _, router in items[:8]], "float32",
                               forced=True)
    own = [check_routes(c, claimed, router.topk(claimed.shape[-1], dim=-1).indices, "float32", router)
           for c, claimed, _, router in items[:8]]
    assert [(f is None) or (f.reason, f.detail) for f in forced] == [(f is None) or (f.reason, f.detail) for f in own]
