"""Verification on the real SmolLM2-135M-Instruct (49,152-token vocabulary, Llama): honest rollouts of
the reverse-text task at batch sizes 1..32 (more requests than slots) are all accepted, and the tamper
classes of test_tamper.py are caught on it. A false-rejection rate is a statistical claim, measured by
`python -m benchmarks.false_bans` (docs), not here."""

import hashlib

import pytest
import torch

from verification.checks import Reason
from verification.claim import RolloutClaim, SamplingSpec
from verification.proof import prove_rollouts
from verification.validator import verify_claims

pytestmark = pytest.mark.slow
ENV = "reverse-text"
MAX_SEQ = 96
MANIFEST = hashlib.sha256(b"smollm2-v0").digest()
RECOMPUTED = {Reason.HIDDEN_MISMATCH, Reason.LOGPROB_MISMATCH, Reason.SAMPLING_MISMATCH}
# (slots, rollouts): more requests than slots (continuous batching: a finished row's slot is refilled)
# at every batch size; 200 rollouts (6, 12, 24, 40, 56, 72) ran 100-200 s in CI for the same property
SETTINGS = [(1, 3), (2, 5), (4, 9), (8, 13), (16, 21), (32, 37)]
SAMPLING = [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0), (1.0, 0.8)]


@pytest.fixture(scope="module")
def smol(smollm2):
    return smollm2.model, smollm2.tokenizer


def _reference(tok, policies):
    from node.replay import TorchReference, env_oracle

    prompt_ids, reward = env_oracle(tok)
    return TorchReference({v: (m, MANIFEST if v == 0 else hashlib.sha256(b"v%d" % v).digest())
                           for v, m in policies.items()}, eos_id=tok.eos_id, max_seq_len=MAX_SEQ,
                          decode=tok.decode, tasks=prompt_ids, reward=reward)


def _claims(model, tok, work, slots=8, prompt_seed=None):
    from node.engine import Engine, Request, SamplingParams
    from node.replay import env_oracle

    prompt_ids, reward = env_oracle(tok)
    engine = Engine(model, max_batch=slots, max_seq_len=MAX_SEQ, eos_id=tok.eos_id, decode=tok.decode,
                    capture_hidden=True)
    reqs = [Request(f"w{s}", prompt_ids(ENV, prompt_seed(s) if prompt_seed else s), SamplingParams(
        temperature=sp.temperature, top_p=sp.top_p, max_new_tokens=sp.max_new_tokens, seed=sp.seed)) for s, sp in work]
    comps = engine.generate(reqs)
    proofs = prove_rollouts([(c.hidden, c.versions) for c in comps], {0: MANIFEST})
    return [RolloutClaim(work_id=s, env=ENV, task_seed=s, prompt_ids=c.prompt_ids, token_ids=c.token_ids,
                         logprobs=c.logprobs, versions=c.versions, sampling=sp, finish_reason=c.finish_reason,
                         reward=reward(ENV, s, c.token_ids), proof=p)
            for c, (s, sp), p in zip(comps, work, proofs)]


def _work(seeds, temperature=None, top_p=None):
    out = []
    for i, s in enumerate(seeds):
        t, p = SAMPLING[i % len(SAMPLING)]
        out.append((s, SamplingSpec(temperature=t if temperature is None else temperature,
                                    top_p=p if top_p is None else top_p, max_new_tokens=6 + s % 11, seed=s)))
    return out


def _verify(claims, ref, chunk=32):
    return [v for i in range(0, len(claims), chunk) for v in verify_claims(claims[i:i + chunk], ref)]


@pytest.mark.slow(seconds=50)
def test_honest_smollm2_rollouts_at_batch_sizes_1_to_32_are_all_accepted(smol):
    model, tok = smol
    ref = _reference(tok, {0: model})
    assert ref.batch_tokens * tok.vocab_size * 4 <= 300 << 20  # prefill logits stay bounded
    claims, seed = [], 7000
    for slots, n in SETTINGS:
        work = _work(range(seed, seed + n))
        seed += n
        claims += _claims(model, tok, work, slots)
    assert len(claims) == sum(n for _, n in SETTINGS) and sum(len(c.token_ids) for c in claims) > 600  # 780 here
    assert sum(c.finish_reason == "eos" for c in claims) > 10  # rows that end early free their slot (34 here)
    assert len(claims[0].proof) <= 2 + 258 * 2 + 64  # proofs stay bounded whatever the vocabulary
    verdicts = _verify(claims, ref)
    rejected = [(c.work_id, v.reason, v.detail) for c, v in zip(claims, verdicts) if not v.accepted]
    assert rejected == []


def test_tampering_is_caught_on_smollm2(smol):
    from verification.calibration.perturb import perturb

    model, tok = smol
    ref = _reference(tok, {0: model})
    work = _work(range(100, 110), temperature=1.0, top_p=1.0)  # 10 rollouts per tamper class (16 took ~90 s in CI)
    honest = _claims(model, tok, work)
    assert all(v.accepted for v in _verify(honest, ref))

    def rejected(claims, reasons):
        verdicts = _verify(claims, ref)
        assert claims and all(not v.accepted for v in verdicts), [v.detail for v in verdicts if v.accepted]
        assert {v.reason for v in verdicts} <= reasons, {v.reason for v in verdicts}

    for kind in ("noise1pct", "int8"):  # other weights or precision
        rejected(_claims(perturb(model, kind), tok, work), RECOMPUTED)
    other = _claims(model, tok, work, prompt_seed=lambda s: s + 1000)  # generated from another prompt
    rejected([o.model_copy(update={"prompt_ids": h.prompt_ids}) for o, h in zip(other, honest)],
             RECOMPUTED | {Reason.REWARD_MISMATCH})
    rejected(other, {Reason.PROMPT_MISMATCH})
    rejected([c.model_copy(update={"logprobs": [min(0.0, lp + 0.3) for lp in c.logprobs]}) for c in honest],
             {Reason.LOGPROB_MISMATCH})
    edited = []
    for c in honest:
        ids = list(c.token_ids)
        i = len(ids) // 2
        ids[i] = 1000 + (ids[i] + 1) % 40000  # another ordinary token
        edited.append(c.model_copy(update={"token_ids": ids}))
    rejected(edited, RECOMPUTED | {Reason.TERMINATION, Reason.REWARD_MISMATCH})
    hot = _work(range(100, 110), temperature=1.5, top_p=1.0)
    cheat = [c.model_copy(update={"sampling": h.sampling}) for c, h in zip(_claims(model, tok, hot), honest)
             if c.token_ids != h.token_ids]
    assert len(cheat) >= len(work) // 2
    rejected(cheat, RECOMPUTED)
    rejected([c.model_copy(update={"reward": 1.0}) for c in honest if c.reward < 1.0], {Reason.REWARD_MISMATCH})
    stopped = [c for c in honest if c.finish_reason == "eos"]
    if stopped:
        rejected([c.model_copy(update={"finish_reason": "length"}) for c in stopped], {Reason.TERMINATION})
    from verification.proof import VersionRun, decode_rollout_proof, encode_rollout_proof

    newer = perturb(model, "noise1pct", seed=7)  # one training step later
    two = _reference(tok, {0: model, 1: newer})
    relabelled = []
    for c in honest:  # tokens of version 0 claimed as version 1 (proof header rewritten to match)
        chunks = [b for r in decode_rollout_proof(c.proof, 64) for b in r.chunks]
        proof = encode_rollout_proof([VersionRun(1, two.manifest_hash(1), len(c.token_ids), chunks)])
        relabelled.append(c.model_copy(update={"versions": [1] * len(c.token_ids), "proof": proof}))
    verdicts = _verify(relabelled, two)
    assert all(not v.accepted and v.reason in RECOMPUTED for v in verdicts), {v.reason for v in verdicts}
