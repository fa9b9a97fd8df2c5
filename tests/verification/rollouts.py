"""Shared test harness: a tiny model, an engine, honest claims, and a reference to check them."""

from __future__ import annotations

import hashlib

import torch

from node.engine import Engine, Request, SamplingParams
from node.model import CausalLM, CharTokenizer, ModelConfig
from node.replay import TorchReference, env_oracle
from verification.claim import RolloutClaim, SamplingSpec
from verification.proof import prove_rollouts

TOK = CharTokenizer()
ENV = "reverse"
MAX_SEQ = 64


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> CausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, intermediate_size=128, max_position_embeddings=MAX_SEQ)
    model = CausalLM(cfg)
    model.reset_parameters(std=0.1)  # a random model that is not nearly uniform
    return model.to(dtype).eval()


def manifest(version: int) -> bytes:
    return hashlib.sha256(f"manifest-{version}".encode()).digest()


def reference(policies: dict[int, CausalLM], max_seq_len: int = MAX_SEQ) -> TorchReference:
    prompt_ids, reward = env_oracle(TOK)
    return TorchReference({v: (m, manifest(v)) for v, m in policies.items()}, eos_id=TOK.eos_id,
                          max_seq_len=max_seq_len, decode=TOK.decode, tasks=prompt_ids, reward=reward)


def spec(seed: int, temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 40) -> SamplingSpec:
    return SamplingSpec(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)


def generate(engine: Engine, work: list[tuple[int, SamplingSpec]], prompt_of=None):
    """Run work items (task seed, sampling) through `engine`; return completions in order."""
    prompt_ids, _ = env_oracle(TOK)
    reqs = []
    for seed, sp in work:
        prompt = prompt_of(seed) if prompt_of else prompt_ids(ENV, seed)
        reqs.append(Request(f"w{seed}", prompt, SamplingParams(
            temperature=sp.temperature, top_p=sp.top_p, max_new_tokens=sp.max_new_tokens, seed=sp.seed)))
    return engine.generate(reqs)


def claims_from(completions, work, engine_version_hashes=None) -> list[RolloutClaim]:
    _, reward = env_oracle(TOK)
    proofs = prove_rollouts([(c.hidden, c.versions) for c in completions],
                            engine_version_hashes or {v: manifest(v) for c in completions for v in c.versions})
    out = []
    for c, (seed, sp), proof in zip(completions, work, proofs):
        out.append(RolloutClaim(work_id=seed, env=ENV, task_seed=seed, prompt_ids=c.prompt_ids, token_ids=c.token_ids,
                                logprobs=c.logprobs, versions=c.versions, sampling=sp, finish_reason=c.finish_reason,
                                reward=reward(ENV, seed, c.token_ids), proof=proof))
    return out


def engine_for(model: CausalLM, max_batch: int = 32) -> Engine:
    return Engine(model, max_batch=max_batch, max_seq_len=MAX_SEQ, eos_id=TOK.eos_id, decode=TOK.decode,
                  capture_hidden=True)


def request(seed: int, sp: SamplingSpec) -> Request:
    prompt_ids, _ = env_oracle(TOK)
    return Request(f"w{seed}", prompt_ids(ENV, seed), SamplingParams(
        temperature=sp.temperature, top_p=sp.top_p, max_new_tokens=sp.max_new_tokens, seed=sp.seed))


def relabel(claims: list[RolloutClaim], version: int, manifest_hash: bytes | None = None) -> list[RolloutClaim]:
    """The same tokens and proofs, every token claimed as `version` (proof headers rewritten)."""
    from verification.proof import VersionRun, decode_rollout_proof, encode_rollout_proof

    out = []
    for c in claims:
        chunks = [b for r in decode_rollout_proof(c.proof, 64) for b in r.chunks]
        # Re-cut into one run: chunk boundaries may differ, so rebuild the chunk list per 32 tokens
        # only when the claim had a single run; otherwise keep the chunks (the cheat's best try).
        run = VersionRun(version, manifest_hash or manifest(version), len(c.token_ids), chunks)
        try:
            proof = encode_rollout_proof([run])
            decode_rollout_proof(proof, 64)
        except Exception:
            proof = encode_rollout_proof([VersionRun(version, run.manifest_hash, len(c.token_ids),
                                                     chunks[: (len(c.token_ids) + 31) // 32])])
        out.append(c.model_copy(update={"versions": [version] * len(c.token_ids), "proof": proof}))
    return out


def claims_from_proof_prefix(claim: RolloutClaim, n: int) -> bytes:
    """A proof for the first n tokens only, re-using the claim's chunks (what a truncating cheat sends)."""
    from verification.proof import VersionRun, decode_rollout_proof, encode_rollout_proof

    chunks = [b for r in decode_rollout_proof(claim.proof, 64) for b in r.chunks][: (n + 31) // 32]
    return encode_rollout_proof([VersionRun(claim.versions[0], manifest(claim.versions[0]), n, chunks)])
