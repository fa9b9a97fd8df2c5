"""How the network treats rollouts whose sampling a validator cannot re-derive (vLLM's generator).

A submission names the engine that sampled it; the run spec names the engines it accepts (default:
only the built-in, seeded one). A claim naming an engine the run does not accept is rejected before
anything is recomputed, so claiming vLLM never dodges the sampling check; in a run that accepts
vLLM, only the re-derivation of choices at temperature > 0 is skipped, and every other check still
binds. Needs no vLLM: the rollouts come from the built-in engine and are labelled.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "verification"))
import rollouts as R  # noqa: E402

from protocol.errors import MalformedMessage  # noqa: E402
from protocol.messages import RolloutSubmission, RunSpec, decode_message, encode_message  # noqa: E402
from verification.checks import Reason, token_logprobs  # noqa: E402
from verification.validator import verify_claims  # noqa: E402

SEEDS = list(range(12))
BOTH = ("builtin", "vllm")


@pytest.fixture(scope="module")
def world():
    model = R.tiny_model()
    work = [(s, R.spec(s)) for s in SEEDS]
    honest = R.claims_from(R.generate(R.engine_for(model), work), work)
    return model, R.reference({0: model}), work, honest


def _as(claims, engine):
    return [c.model_copy(update={"engine": engine}) for c in claims]


def test_claiming_vllm_in_a_run_that_does_not_accept_it_is_rejected(world):
    _, ref, _, honest = world
    assert all(v.accepted for v in verify_claims(honest, ref))
    verdicts = verify_claims(_as(honest, "vllm"), ref)  # default: the built-in engine only
    assert [v.reason for v in verdicts] == [Reason.ENGINE_NOT_ALLOWED] * len(honest)


def test_honest_vllm_labelled_rollouts_pass_where_the_run_accepts_vllm(world):
    _, ref, _, honest = world
    assert all(v.accepted for v in verify_claims(_as(honest, "vllm"), ref, engines=BOTH))
    assert all(v.accepted for v in verify_claims(honest, ref, engines=BOTH))


def _hot_with_refitted_logprobs(model, ref, work, honest):
    """Tokens drawn at T=1.3 but claimed at T=1.0 with logprobs recomputed at 1.0: only the
    seeded-sampling replay can tell (tests/verification/test_tamper.py)."""
    hot = [(s, R.spec(s, temperature=1.3)) for s, _ in work]
    out = []
    for c, h in zip(R.claims_from(R.generate(R.engine_for(model), hot), hot), honest):
        if c.token_ids == h.token_ids:
            continue
        logits, _ = ref.prefill(0, [c.prompt_ids + c.token_ids[:-1]])[0]
        rows = torch.arange(len(c.prompt_ids) - 1, len(c.prompt_ids) - 1 + len(c.token_ids))
        lp = token_logprobs(logits[rows], torch.tensor(c.token_ids), 1.0).tolist()
        out.append(c.model_copy(update={"sampling": h.sampling, "logprobs": lp}))
    return out


def test_only_the_sampling_replay_is_skipped_for_vllm_rollouts(world):
    model, ref, work, honest = world
    cheat = _hot_with_refitted_logprobs(model, ref, work, honest)
    assert len(cheat) >= len(work) // 2
    builtin = verify_claims(cheat, ref, engines=BOTH)
    assert not any(v.accepted for v in builtin) and {v.reason for v in builtin} == {Reason.SAMPLING_MISMATCH}
    # The price of accepting vLLM, made explicit: a choice of tokens that keeps honest logprobs and
    # proofs is not caught once the run accepts engines whose sampling cannot be re-derived.
    assert all(v.accepted for v in verify_claims(_as(cheat, "vllm"), ref, engines=BOTH))


def test_every_other_check_still_binds_vllm_rollouts(world):
    _, ref, _, honest = world
    c = _as(honest, "vllm")[0]
    tokens = list(c.token_ids)
    tokens[3] = (tokens[3] + 7) % R.TOK.vocab_size if tokens[3] != R.TOK.eos_id else 10
    logprobs = list(c.logprobs)
    logprobs[2] -= 0.5
    cheats = {
        "reward": (c.model_copy(update={"reward": c.reward + 1.0}), {Reason.REWARD_MISMATCH}),
        "tokens": (c.model_copy(update={"token_ids": tokens}), {Reason.HIDDEN_MISMATCH, Reason.LOGPROB_MISMATCH,
                                                                 Reason.REWARD_MISMATCH, Reason.TERMINATION}),
        "logprobs": (c.model_copy(update={"logprobs": logprobs}), {Reason.LOGPROB_MISMATCH}),
        "version": (R.relabel([c], 1, R.manifest(1))[0], {Reason.UNKNOWN_VERSION}),
        "termination": (c.model_copy(update={"finish_reason": "length" if c.finish_reason != "length" else "eos"}),
                        {Reason.TERMINATION}),
    }
    for name, (claim, reasons) in cheats.items():
        v = verify_claims([claim], ref, engines=BOTH)[0]
        assert not v.accepted and v.reason in reasons, (name, v.reason, v.detail)


def test_greedy_vllm_choices_are_still_replayed(world):
    model, ref, _, _ = world
    greedy = [(s, R.spec(s, temperature=0.0)) for s in SEEDS]
    honest = _as(R.claims_from(R.generate(R.engine_for(model), greedy), greedy), "vllm")
    assert all(v.accepted for v in verify_claims(honest, ref, engines=BOTH))
    hot = [(s, R.spec(s, temperature=1.0)) for s in SEEDS]  # sampled, then claimed as greedy
    claims = []
    for c, h in zip(R.claims_from(R.generate(R.engine_for(model), hot), hot), honest):
        if c.token_ids != h.token_ids:
            claims.append(c.model_copy(update={"sampling": h.sampling, "engine": "vllm"}))
    assert claims
    verdicts = verify_claims(claims, ref, engines=BOTH)
    assert not any(v.accepted for v in verdicts)
    assert Reason.SAMPLING_MISMATCH in {v.reason for v in verdicts}


def test_engine_fields_are_backward_compatible_on_the_wire():
    spec = RunSpec(run_id="r", coordinator="c")
    assert spec.engines == ("builtin",) and b"engines" not in encode_message(spec)  # old bytes, old hash
    both = RunSpec(run_id="r", coordinator="c", engines=BOTH)
    assert decode_message(encode_message(both)) == both and both.spec_hash() != spec.spec_hash()
    sub = RolloutSubmission(work_id=1, version_runs=[(0, 2)], token_ids=[5, 6], logprobs=[-0.1, -0.2], reward=0.0,
                            finish_reason="eos")
    old_bytes = encode_message(sub)
    assert sub.engine == "builtin" and b"engine" not in old_bytes and decode_message(old_bytes) == sub
    vllm = sub.model_copy(update={"engine": "vllm"})
    assert decode_message(encode_message(vllm)).engine == "vllm"
    with pytest.raises(MalformedMessage):
        decode_message(old_bytes[:-1] + b',"engine":"sglang"}')


def test_validator_role_bans_a_vllm_claim_only_where_the_run_does_not_accept_vllm(tmp_path):
    """Through the roles: an inference node's signed groups, relabelled, judged by the validator role."""
    import asyncio

    from node.roles.common import fresh_model
    from node.roles.resident_policy import ResidentPolicies
    from node.roles.validator import ValidatorNode
    from protocol.identity import NodeKey
    from protocol.messages import StoredWork
    from protocol.work import open_unit
    from role_rollouts import rolled_out, stored as signed_groups

    spec = RunSpec(run_id="r", coordinator="c", environment="reverse", group_size=2, recipe={"hidden": 64})
    model = fresh_model(spec)
    manifest = "ab" * 32
    key, grants, groups = rolled_out(spec, model, manifest, tmp_path / "inference", 3)

    def stored(engine: str) -> list[StoredWork]:
        relabelled = [g.model_copy(update={"rollouts": [r.model_copy(update={"engine": engine}) for r in g.rollouts]})
                      for g in groups]
        return signed_groups(key, spec, grants, relabelled)

    def judge(run_spec: RunSpec, items: list[StoredWork]):
        v = ValidatorNode(NodeKey.generate(), run_spec, "", tmp_path / "validator")
        v.hashes, v.policies = {0: manifest}, ResidentPolicies(model, 0, bytes.fromhex(manifest))
        return asyncio.run(v._judge([open_unit(item, run_spec.run_id, run_spec.group_size) for item in items]))

    assert all(v.valid for v in judge(spec, stored("builtin")))
    refused = judge(spec, stored("vllm"))
    assert all(not v.valid and v.reason.startswith("engine_not_allowed") for v in refused), refused
    assert all(v.submitter == key.peer_id for v in refused)  # the coordinator bans the submitter of a failing verdict
    accepting = spec.model_copy(update={"engines": BOTH})
    assert all(v.valid for v in judge(accepting, stored("vllm")))
