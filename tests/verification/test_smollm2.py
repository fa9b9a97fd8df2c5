"""The same checks on a real pretrained model, SmolLM2-135M-Instruct (Llama), loaded offline."""

import hashlib

import pytest
import torch

from verification.checks import Reason
from verification.claim import RolloutClaim, SamplingSpec
from verification.proof import prove_rollouts
from verification.validator import verify_claims

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
           "The three primary colours are"]


@pytest.fixture(scope="module")
def smol(smollm2):
    return smollm2.model, smollm2.tokenizer.hf  # transformers' tokenizer: encode/decode, eos_token_id


def _reference(model, tok):
    from node.replay import TorchReference

    return TorchReference({0: (model, hashlib.sha256(b"smol-v0").digest())}, eos_id=tok.eos_token_id, max_seq_len=128,
                          decode=tok.decode, tasks=lambda env, seed: tok.encode(PROMPTS[seed]),
                          reward=lambda env, seed, ids: 0.0)


def _rollouts(model, tok, prompts_of=None):
    from node.engine import Engine, Request, SamplingParams

    engine = Engine(model, max_batch=4, max_seq_len=128, eos_id=tok.eos_token_id, decode=tok.decode, capture_hidden=True)
    specs = [SamplingSpec(temperature=0.7, top_p=0.95, max_new_tokens=40, seed=100 + i) for i in range(len(PROMPTS))]
    reqs = [Request(f"r{i}", tok.encode((prompts_of or PROMPTS)[i]), SamplingParams(
        temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens, seed=s.seed)) for i, s in enumerate(specs)]
    comps = engine.generate(reqs)
    proofs = prove_rollouts([(c.hidden, c.versions) for c in comps], {0: hashlib.sha256(b"smol-v0").digest()})
    return [RolloutClaim(work_id=i, env="chat", task_seed=i, prompt_ids=tok.encode(PROMPTS[i]), token_ids=c.token_ids,
                         logprobs=c.logprobs, versions=c.versions, sampling=specs[i], finish_reason=c.finish_reason,
                         reward=0.0, proof=p) for i, (c, p) in enumerate(zip(comps, proofs))]


@pytest.mark.slow(seconds=55)
def test_smollm2_honest_generations_pass_and_tampering_is_caught(smol):
    from verification.calibration.perturb import perturb

    model, tok = smol
    ref = _reference(model, tok)
    torch.manual_seed(0)
    honest = _rollouts(model, tok)
    assert sum(len(c.token_ids) for c in honest) > 60
    assert [v.reason for v in verify_claims(honest, ref)] == [Reason.OK] * len(PROMPTS)
    recomputed = {Reason.HIDDEN_MISMATCH, Reason.LOGPROB_MISMATCH, Reason.SAMPLING_MISMATCH}
    for kind in ("noise1pct", "int8"):
        cheat = _rollouts(perturb(model, kind), tok)
        verdicts = verify_claims(cheat, ref)
        assert all(not v.accepted and v.reason in recomputed for v in verdicts), (kind, [v.detail for v in verdicts])
    other = ["The capital of Spain is", "def factorial(n):", "Once upon a time, a large dragon",
             "The three secondary colours are"]
    cheat = _rollouts(model, tok, prompts_of=other)  # claims carry the leased prompts
    verdicts = verify_claims(cheat, ref)
    assert all(not v.accepted and v.reason in recomputed for v in verdicts), [v.detail for v in verdicts]
