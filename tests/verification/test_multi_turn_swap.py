"""A multi-turn rollout whose policy changed between two turns: the engine prefilled the second turn's
whole history (prompt, first turn, tool reply) under the new version, so the validator must recompute
that turn the same way, and an honest node must pass (the sim's verifiers run banned one, session 14)."""

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import rollouts as R  # noqa: E402

from node.engine import Engine, Request, SamplingParams  # noqa: E402
from node.model.routing import RouteShape, encode_routes, rollout_routes  # noqa: E402
from node.replay import env_oracle  # noqa: E402
from verification.calibration.perturb import perturb  # noqa: E402
from verification.claim import RolloutClaim, SamplingSpec  # noqa: E402
from verification.proof import prove_rollouts  # noqa: E402
from verification.validator import verify_claims  # noqa: E402

STOPS = tuple(R.TOK.encode("aeiou "))  # a turn ends at one of these (a tool call, as a stop token)


def run_turn(engine, rid: str, prompt: list[int], sp: SamplingSpec):
    engine.add_request(Request(rid, prompt, SamplingParams(temperature=sp.temperature, top_p=sp.top_p,
                                                           max_new_tokens=sp.max_new_tokens, seed=sp.seed,
                                                           stop_token_ids=sp.stop_token_ids)))
    done = []
    while engine.has_work():
        done += engine.step()
    (completion,) = done
    return completion


def two_turn_claims(swap: bool, seeds=range(24), routes: bool = False) -> list[RolloutClaim]:
    """Turn 0 under version 0; then (with `swap`) version 1 is loaded; a tool reply; turn 1 (`routes`:
    with the experts each position was routed to, for router replay)."""
    model = R.tiny_model()
    newer = perturb(model, "noise1pct", seed=7)
    engine = Engine(copy.deepcopy(model), max_batch=32, max_seq_len=R.MAX_SEQ, eos_id=R.TOK.eos_id,
                    decode=R.TOK.decode, capture_hidden=True, capture_experts=routes)
    prompt_of, reward = env_oracle(R.TOK)
    reply = R.TOK.encode("=42;")
    claims = []
    for s in seeds:
        sp = SamplingSpec(temperature=1.0, max_new_tokens=12, seed=s, stop_token_ids=STOPS)
        prompt = prompt_of(R.ENV, s)
        a = run_turn(engine, f"w{s}/0", prompt, sp)
        if a.finish_reason != "stop":
            continue
        if swap:
            engine.load_weights({k: v.clone() for k, v in newer.state_dict().items()}, version=1)
        b = run_turn(engine, f"w{s}/1", prompt + a.token_ids + reply, sp)
        if swap:  # back to version 0 for the next rollout's first turn
            engine.load_weights({k: v.clone() for k, v in model.state_dict().items()}, version=0)
        tokens = a.token_ids + reply + b.token_ids
        (proof,) = prove_rollouts([(torch.cat([a.hidden, b.hidden]), a.versions + b.versions)],
                                  {v: R.manifest(v) for v in (0, 1)})
        claims.append(RolloutClaim(
            work_id=s, env=R.ENV, task_seed=s, prompt_ids=prompt, token_ids=tokens,
            logprobs=a.logprobs + [0.0] * len(reply) + b.logprobs,
            versions=a.versions + [a.versions[-1]] * len(reply) + b.versions,
            sampled=[True] * len(a.token_ids) + [False] * len(reply) + [True] * len(b.token_ids),
            sampling=sp, finish_reason=b.finish_reason, reward=reward(R.ENV, s, tokens), proof=proof,
            routed_experts=encode_routes(rollout_routes([a.routed_experts, b.routed_experts]), RouteShape.of(model.config))
            if routes else None))
    return claims, model, newer


def test_a_rollout_whose_version_changed_between_turns_passes_and_a_relabelled_one_fails():
    claims, model, newer = two_turn_claims(swap=True)
    assert len(claims) >= 8 and all(set(c.versions) == {0, 1} for c in claims)
    ref = R.reference({0: model, 1: newer})
    verdicts = verify_claims(claims, ref)
    assert all(v.accepted for v in verdicts), [(v.reason, v.detail) for v in verdicts if not v.accepted]
    # the second turn claimed as version 0 (the weights it was not sampled with): rejected
    cheats = [c.model_copy(update={"versions": [0] * len(c.versions)}) for c in claims]
    assert not any(v.accepted for v in verify_claims(cheats, ref))


def test_two_turns_under_one_version_pass_as_before():
    claims, model, newer = two_turn_claims(swap=False)
    assert len(claims) >= 8
    verdicts = verify_claims(claims, R.reference({0: model, 1: newer}))
    assert all(v.accepted for v in verdicts), [(v.reason, v.detail) for v in verdicts if not v.accepted]


def test_with_router_replay_the_routes_of_a_turn_swapped_rollout_pass_and_forged_ones_fail():
    claims, model, newer = two_turn_claims(swap=True, routes=True)
    assert len(claims) >= 8 and all(c.routed_experts for c in claims)
    ref = R.reference({0: model, 1: newer})
    verdicts = verify_claims(claims, ref)
    assert all(v.accepted for v in verdicts), [(v.reason, v.detail) for v in verdicts if not v.accepted]
    shape = RouteShape.of(model.config)
    forged = []
    for c in claims:  # every position sent to the same experts (the last top-k), whatever its router chose
        n = len(c.prompt_ids) + len(c.token_ids) - 1
        worst = torch.arange(shape.num_experts - shape.top_k, shape.num_experts).expand(n, shape.moe_layers, -1)
        forged.append(c.model_copy(update={"routed_experts": encode_routes(worst, shape)}))
    assert sum(not v.accepted for v in verify_claims(forged, ref)) >= len(forged) // 2


def test_a_claim_of_many_tiny_turns_across_a_version_change_is_refused_not_recomputed_quadratically():
    from verification.checks import Reason, Severity
    from verification.validator import MAX_TURN_PASSES

    claims, model, newer = two_turn_claims(swap=True)
    c = claims[0]
    n = 2 * (MAX_TURN_PASSES + 1)  # one-token turns, each ended by a stop token, a version change after the first
    tokens = [STOPS[0]] * n
    versions = [0] + [1] * (n - 1)
    sampled = [i % 2 == 0 for i in range(n)]
    (proof,) = prove_rollouts([(torch.randn(n // 2, model.config.hidden_size),
                                [v for v, m in zip(versions, sampled) if m])], {v: R.manifest(v) for v in (0, 1)})
    _, reward = env_oracle(R.TOK)
    hostile = c.model_copy(update={"token_ids": tokens, "logprobs": [0.0] * n, "versions": versions,
                                   "sampled": sampled, "finish_reason": "stop", "proof": proof,
                                   "reward": reward(R.ENV, c.task_seed, tokens)})
    (v,) = verify_claims([hostile], R.reference({0: model, 1: newer}))
    assert not v.accepted and v.reason == Reason.MALFORMED and v.severity == Severity.BORDERLINE, (v.reason, v.detail)
    assert "turns across a version change" in v.detail
