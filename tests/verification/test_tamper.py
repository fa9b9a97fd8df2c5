"""The tamper suite: each way of cheating is rejected; the honest rollouts beside it are accepted."""

import copy
import hashlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import rollouts as R  # noqa: E402

from verification.calibration.perturb import perturb  # noqa: E402
from verification.checks import Reason, Severity  # noqa: E402
from verification.validator import verify_claims  # noqa: E402

SEEDS = list(range(24))
RECOMPUTED = {Reason.HIDDEN_MISMATCH, Reason.LOGPROB_MISMATCH, Reason.SAMPLING_MISMATCH}


@pytest.fixture(scope="module")
def world():
    model = R.tiny_model()
    work = [(s, R.spec(s)) for s in SEEDS]
    honest = R.claims_from(R.generate(R.engine_for(model), work), work)
    return model, R.reference({0: model}), work, honest


def _edit(claim, **kw):
    return claim.model_copy(update=kw)


def _diverges_beyond_noise(cheat, honest, ref) -> bool:
    """Whether the cheat's first token that differs from the honest rollout was a binding choice:
    there the prefixes agree, so the validator's seeded replay gives the honest token, and it
    binds when its top-two margin exceeds the noise threshold (a near-tie may go either way)."""
    from verification.checks import THRESHOLDS

    i = next((j for j, (a, b) in enumerate(zip(cheat.token_ids, honest.token_ids)) if a != b), None)
    if i is None:
        return False
    logits, _ = ref.prefill(0, [honest.prompt_ids + honest.token_ids[:i + 1]])[0]
    replay = ref.replay_sampling(logits[len(honest.prompt_ids) - 1 + i][None], honest.sampling,
                                 [len(honest.prompt_ids) + i])
    return float(replay.margins[0]) > THRESHOLDS[ref.precision].margin_noise


def _assert_all_rejected(claims, ref, reasons):
    verdicts = verify_claims(claims, ref)
    assert claims and all(not v.accepted for v in verdicts), [v.detail for v in verdicts if v.accepted]
    assert {v.reason for v in verdicts} <= reasons, {v.reason for v in verdicts}
    return verdicts


def test_honest_rollouts_are_accepted(world):
    _, ref, _, honest = world
    verdicts = verify_claims(honest, ref)
    assert [v.reason for v in verdicts] == [Reason.OK] * len(honest)


@pytest.mark.parametrize("kind", ["noise1pct", "fp8", "int8"])
def test_other_weights_or_precision_are_rejected(world, kind):
    model, ref, work, _ = world
    cheat = R.claims_from(R.generate(R.engine_for(perturb(model, kind)), work), work)
    _assert_all_rejected(cheat, ref, RECOMPUTED)


def test_another_prompt_is_rejected(world):
    model, ref, work, honest = world
    other = R.generate(R.engine_for(model), work, prompt_of=lambda s: R.env_oracle(R.TOK)[0](R.ENV, s + 1000))
    cheat = R.claims_from(other, work)
    # The node claims the leased task's prompt but generated from another one.
    cheat = [_edit(c, prompt_ids=h.prompt_ids) for c, h in zip(cheat, honest)]
    _assert_all_rejected(cheat, ref, RECOMPUTED | {Reason.REWARD_MISMATCH})
    # Claiming the other prompt outright is caught before any recomputation.
    _assert_all_rejected(R.claims_from(other, work), ref, {Reason.PROMPT_MISMATCH})


def test_edited_tokens_are_rejected(world):
    _, ref, _, honest = world
    cheat = []
    for c in honest:
        ids = list(c.token_ids)
        i = len(ids) // 2
        ids[i] = 3 + (ids[i] + 1) % (R.TOK.vocab_size - 3)  # another ordinary character
        if ids[i] == R.TOK.eos_id:
            continue
        cheat.append(_edit(c, token_ids=ids, reward=R.env_oracle(R.TOK)[1](R.ENV, c.task_seed, ids)))
    _assert_all_rejected(cheat, ref, RECOMPUTED | {Reason.TERMINATION})


def test_fabricated_logprobs_are_rejected(world):
    _, ref, _, honest = world
    cheat = [_edit(c, logprobs=[min(0.0, lp + 0.3) for lp in c.logprobs]) for c in honest]
    _assert_all_rejected(cheat, ref, {Reason.LOGPROB_MISMATCH})


def test_temperature_1_3_used_while_1_0_claimed_is_rejected(world):
    model, ref, work, honest = world
    hot = [(s, R.spec(s, temperature=1.3)) for s, _ in work]
    cheat = R.claims_from(R.generate(R.engine_for(model), hot), hot)
    cheat = [_edit(c, sampling=h.sampling) for c, h in zip(cheat, honest)]
    _assert_all_rejected(cheat, ref, RECOMPUTED)


def test_temperature_cheat_with_refitted_logprobs_is_caught_by_sampling_replay(world):
    from verification.checks import token_logprobs

    model, ref, work, honest = world
    hot = [(s, R.spec(s, temperature=1.3)) for s, _ in work]
    cheat = []
    for c, h in zip(R.claims_from(R.generate(R.engine_for(model), hot), hot), honest):
        if not _diverges_beyond_noise(c, h, ref):
            continue  # the same tokens as an honest T=1.0 run, or first differing at a near-tie
        logits, _ = ref.prefill(0, [c.prompt_ids + c.token_ids[:-1]])[0]
        rows = torch.arange(len(c.prompt_ids) - 1, len(c.prompt_ids) - 1 + len(c.token_ids))
        lp = token_logprobs(logits[rows], torch.tensor(c.token_ids), 1.0).tolist()
        cheat.append(_edit(c, sampling=h.sampling, logprobs=lp))
    assert len(cheat) >= len(work) // 2
    _assert_all_rejected(cheat, ref, {Reason.SAMPLING_MISMATCH})


def test_ignoring_top_p_is_rejected(world):
    model, ref, work, _ = world
    nucleus = [(s, R.spec(s, top_p=0.7)) for s, _ in work]
    honest_p = R.claims_from(R.generate(R.engine_for(model), nucleus), nucleus)
    assert all(v.accepted for v in verify_claims(honest_p, ref))
    full = [(s, R.spec(s, top_p=1.0)) for s, _ in work]
    cheat = [_edit(c, sampling=h.sampling) for c, h in
             zip(R.claims_from(R.generate(R.engine_for(model), full), full), honest_p)
             if _diverges_beyond_noise(c, h, ref)]
    assert len(cheat) >= len(work) // 2  # the rest sampled inside the nucleus anyway: identical, honest output
    _assert_all_rejected(cheat, ref, {Reason.SAMPLING_MISMATCH})


def test_early_stop_is_rejected(world):
    _, ref, _, honest = world
    cheat = []
    for c in honest:
        if len(c.token_ids) < 6:
            continue
        n = len(c.token_ids) // 2
        cheat.append(_edit(c, token_ids=c.token_ids[:n], logprobs=c.logprobs[:n], versions=c.versions[:n],
                           finish_reason="length", proof=R.claims_from_proof_prefix(c, n)))
    _assert_all_rejected(cheat, ref, {Reason.TERMINATION, Reason.REWARD_MISMATCH})


def test_continuing_past_eos_is_rejected(world):
    _, ref, _, honest = world
    stopped = [c for c in honest if c.finish_reason == "eos"]
    assert stopped
    cheat = [_edit(c, finish_reason="length") for c in stopped]
    _assert_all_rejected(cheat, ref, {Reason.TERMINATION})


def test_inflated_reward_is_rejected(world):
    _, ref, _, honest = world
    cheat = [_edit(c, reward=1.0) for c in honest if c.reward < 1.0]
    _assert_all_rejected(cheat, ref, {Reason.REWARD_MISMATCH})


def test_claimed_version_the_tokens_did_not_come_from_is_rejected(world):
    model, _, work, _ = world
    newer = perturb(model, "noise1pct", seed=7)  # one training step later
    ref = R.reference({0: model, 1: newer})
    from_v0 = R.claims_from(R.generate(R.engine_for(model), work), work)
    relabelled = R.relabel(from_v0, 1)
    _assert_all_rejected(relabelled, ref, RECOMPUTED)
    # An unknown version, or a known one under another manifest hash, is refused outright.
    _assert_all_rejected(R.relabel(from_v0, 5), ref, {Reason.UNKNOWN_VERSION})
    forged = R.relabel(from_v0, 1, manifest_hash=hashlib.sha256(b"forged").digest())
    _assert_all_rejected(forged, ref, {Reason.UNKNOWN_VERSION})


def test_mixed_version_rollouts_are_checked_segment_by_segment(world):
    model, _, work, _ = world
    newer = perturb(model, "noise1pct", seed=7)
    ref = R.reference({0: model, 1: newer})
    engine = R.engine_for(copy.deepcopy(model))  # the swap loads weights into the engine's model in place
    for s, sp in work:
        engine.add_request(R.request(s, sp))
    done = []
    for _ in range(10):
        done += engine.step()
    engine.load_weights({k: v.clone() for k, v in newer.state_dict().items()}, version=1)
    while engine.has_work():
        done += engine.step()
    done.sort(key=lambda c: int(c.request_id[1:]))
    claims = R.claims_from(done, work)
    mixed = [c for c in claims if len(set(c.versions)) == 2]
    assert len(mixed) >= len(work) // 2
    assert all(v.accepted for v in verify_claims(claims, ref)), [v.detail for v in verify_claims(claims, ref)]
    # The same tokens all claimed as version 1: the version-0 segment fails against version 1.
    _assert_all_rejected(R.relabel(mixed, 1), ref, RECOMPUTED)


def test_malformed_claims_are_rejected_without_crashing(world):
    _, ref, _, honest = world
    c = honest[0]
    bad = [
        _edit(c, proof=c.proof[:-3]),
        _edit(c, proof=b""),
        _edit(c, token_ids=[10**6] + c.token_ids[1:]),
        _edit(c, versions=[0] * (len(c.versions) - 1) + [1]),
    ]
    verdicts = verify_claims(bad + [c], ref)
    assert [v.accepted for v in verdicts] == [False] * len(bad) + [True]
    assert all(v.reason in (Reason.MALFORMED, Reason.UNKNOWN_VERSION) for v in verdicts[:-1])


def test_failures_carry_a_severity_proof_for_deterministic_or_far_past_tolerance(world):
    """What the coordinator bans on (proof) vs counts as a strike (borderline): a wrong reward or
    prompt, or hidden states of 1%-noise weights, are proof; an honest verdict has none."""
    model, ref, work, honest = world
    inflated = [_edit(c, reward=c.reward + 1.0) for c in honest[:4]]
    noisy = R.claims_from(R.generate(R.engine_for(perturb(model, "noise1pct")), work), work)
    other = R.generate(R.engine_for(model), work[:4], prompt_of=lambda s: R.env_oracle(R.TOK)[0](R.ENV, s + 1000))
    verdicts = verify_claims(inflated + noisy + R.claims_from(other, work[:4]) + honest[:4], ref)
    assert all(v.severity == Severity.PROOF for v in verdicts[:-4]), [(v.reason, v.detail) for v in verdicts
                                                                      if v.severity != Severity.PROOF][:3]
    assert all(v.accepted and v.severity == Severity.NONE for v in verdicts[-4:])


def test_a_short_segment_is_judged_per_token_not_by_a_mean_of_few_tokens():
    """A mixed-version rollout can end with a segment of one or two tokens; the mean check of such a
    segment was as loose as one token, so it applies from MIN_MEAN_TOKENS tokens (per-token bound
    always)."""
    from verification.checks import MIN_MEAN_TOKENS, THRESHOLDS

    t = THRESHOLDS["bfloat16"]
    honest_tail = 0.17  # the largest honest bf16 per-token error calibration measured
    assert honest_tail < t.max_logprob_err and honest_tail > t.max_logprob_err_mean
    # one honest token fails a mean of 7 tokens at the bound in force (0.023; of 16 at the CPU-only 0.01)
    assert honest_tail / 7 > t.max_logprob_err_mean
    assert honest_tail / MIN_MEAN_TOKENS < t.max_logprob_err_mean  # it no longer can alone


def test_one_token_near_the_logprob_line_passes_two_or_one_far_off_do_not(world):
    """Honest bf16 logprob errors are heavy-tailed (benchmarks.false_bans: single tokens at 0.27-0.35
    nats against a 0.25 bound, each a strike): one token between the bound and PROOF_FACTOR times it
    passes; two such tokens are a borderline failure, one token past PROOF_FACTOR x is proof."""
    from verification.checks import LOGPROB_OUTLIERS, PROOF_FACTOR, THRESHOLDS

    _, ref, _, honest = world
    tol = THRESHOLDS[ref.precision].max_logprob_err
    assert LOGPROB_OUTLIERS == 1

    def shifted(c, positions, by):
        lps = list(c.logprobs)
        for i in positions:
            lps[i] = lps[i] - by  # lower: a logprob never exceeds 0
        return _edit(c, logprobs=lps)
    near = [shifted(c, [len(c.logprobs) // 2], 1.5 * tol) for c in honest[:6]]
    two = [shifted(c, [0, len(c.logprobs) - 1], 1.5 * tol) for c in honest[:6] if len(c.logprobs) >= 2]
    far = [shifted(c, [len(c.logprobs) // 2], (PROOF_FACTOR + 0.5) * tol) for c in honest[:6]]
    v_near, v_two, v_far = (verify_claims(x, ref) for x in (near, two, far))
    assert all(v.accepted for v in v_near), [v.detail for v in v_near if not v.accepted]
    assert two and all(not v.accepted and v.reason == Reason.LOGPROB_MISMATCH and v.severity == Severity.BORDERLINE
                       for v in v_two), [(v.reason, v.severity) for v in v_two]
    assert all(not v.accepted and v.severity == Severity.PROOF for v in v_far)
