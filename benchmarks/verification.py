"""Verification benchmark: our TOPLOC-style proofs against the `toploc` package on the same
activations, detection per tamper case, proof overhead in our engine, verification throughput.

    python -m benchmarks.verification [--rollouts 64] [--hidden 512] [--layers 4]

Peer measured in the same run: `toploc` 0.1.6 (built from source into the venv; the run fails
without it) on the same hidden states: build and verify time, bytes per 32 tokens, and detection
on the cases it covers (its hidden-state check, held to our float32 thresholds; it has no
logprob, sampling, termination or reward check). Prints progress, then one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import platform
import sys
import time
from pathlib import Path

import torch

from verification.calibration.perturb import perturb
from verification.checks import THRESHOLDS, Reason
from verification.hidden_check import compare_blocks
from verification.proof import (Commitment, build_proofs_many, chunk_blocks, chunk_spans, decode_rollout_proof,
                                prove_rollouts)
from verification.validator import verify_claims

log = logging.getLogger("bench.verification")
sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "verification"))
import rollouts as R  # noqa: E402  (the shared harness: model, engine, claims)


def model_of(hidden: int, layers: int) -> torch.nn.Module:
    from node.model import CausalLM, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=R.TOK.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=hidden // 2, intermediate_size=hidden * 2,
                      max_position_embeddings=R.MAX_SEQ)
    m = CausalLM(cfg)
    m.reset_parameters(std=0.5 / hidden**0.5)
    return m.eval()


def timed(fn, repeat: int = 3):
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def toploc_hidden_rejects(toploc_verify, claims, ref) -> list[bool]:
    """toploc's check on each claim: its verify over the validator's recomputed hidden states."""
    t = THRESHOLDS[ref.precision]
    out = []
    outs = ref.prefill(0, [c.prompt_ids + c.token_ids[:-1] for c in claims])
    for c, (_, hidden) in zip(claims, outs):
        rows = hidden[len(c.prompt_ids) - 1 :].to(torch.bfloat16)
        chunks = [b for r in decode_rollout_proof(c.proof, ref.hidden_size) for b in r.chunks]
        res = toploc_verify(rows.contiguous(), chunks, 32, 128)
        out.append(any(r.exp_mismatches > t.max_exp_mismatches or r.mant_err_mean > t.max_mant_err_mean
                       or r.mant_err_median > t.max_mant_err_median for r in res))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import toploc
    from toploc.C.csrc.poly import verify_proofs_bytes

    torch.set_num_threads(args.threads)
    model = model_of(args.hidden, args.layers)
    ref = R.reference({0: model})
    ref.hidden_size = args.hidden
    work = [(s, R.spec(s, max_new_tokens=48)) for s in range(args.rollouts)]

    # 1. generation with and without hidden capture, then proofs (off the hot path, after completion)
    def gen(capture: bool, max_batch: int = 32):
        eng = R.engine_for(model, max_batch=max_batch)
        eng.capture_hidden = capture
        return R.generate(eng, work)

    t_plain, _ = timed(lambda: gen(False), 2)
    t_gen, comps = timed(lambda: gen(True), 2)
    t_gen1, _ = timed(lambda: gen(True, 1), 1)
    n_tokens = sum(len(c.token_ids) for c in comps)
    hashes = {0: R.manifest(0)}
    t_prove, proofs = timed(lambda: prove_rollouts([(c.hidden, c.versions) for c in comps], hashes))
    log.info("generation %.2fs (%.0f tok/s), capture adds %.1f%%, proofs %.3fs (%.2f%% of generation)",
             t_gen, n_tokens / t_gen, 100 * (t_gen - t_plain) / t_plain, t_prove, 100 * t_prove / t_gen)
    claims = R.claims_from(comps, work)

    # 2. verification throughput (full checks: one prefill per version + every check)
    t_verify, verdicts = timed(lambda: verify_claims(claims, ref), 2)
    assert all(v.accepted for v in verdicts), [v.detail for v in verdicts if not v.accepted][:3]
    log.info("verification %.2fs: %.0f tok/s = %.1fx generation at batch 32, %.1fx at batch 1",
             t_verify, n_tokens / t_verify, t_gen / t_verify, t_gen1 / t_verify)

    # 3. ours vs toploc on the same activations (all rollouts' hidden states)
    acts = [(c.hidden, c.versions) for c in comps]
    t_ours_build, ours = timed(lambda: build_proofs_many(acts))
    t_tl_build, theirs = timed(lambda: [toploc.build_proofs_bytes([h[i].to(torch.bfloat16) for i in range(h.shape[0])], 32,
                                                                  128, skip_prefill=True) for h, _ in acts])
    same = [b for r in ours for _, b in r] == [b for r in theirs for b in r]
    n_chunks = sum(len(r) for r in ours)

    def our_verify():
        return [compare_blocks(chunk_blocks(h, chunk_spans(v)), [Commitment.from_bytes(b) for _, b in r])
                for (h, v), r in zip(acts, ours)]

    def their_verify():
        return [verify_proofs_bytes(h.to(torch.bfloat16), r, 32, 128) for (h, _), r in zip(acts, theirs)]

    t_ours_verify, _ = timed(our_verify)
    t_tl_verify, _ = timed(their_verify)
    log.info("build: ours %.2f ms/chunk, toploc %.2f ms/chunk (bytes identical: %s); verify: ours %.3f, toploc %.3f ms/chunk",
             1e3 * t_ours_build / n_chunks, 1e3 * t_tl_build / n_chunks, same, 1e3 * t_ours_verify / n_chunks,
             1e3 * t_tl_verify / n_chunks)

    # 4. detection per tamper case: ours (all checks) vs toploc (hidden-state check only)
    def cheat_claims(kind: str):
        if kind in ("noise1pct", "fp8", "int8"):
            return R.claims_from(R.generate(R.engine_for(perturb(model, kind)), work), work)
        if kind == "prompt":
            other = R.generate(R.engine_for(model), work, prompt_of=lambda s: R.env_oracle(R.TOK)[0](R.ENV, s + 999))
            return [c.model_copy(update={"prompt_ids": h.prompt_ids}) for c, h in zip(R.claims_from(other, work), claims)]
        if kind == "temperature_1.3":
            hot = [(s, R.spec(s, temperature=1.3, max_new_tokens=48)) for s, _ in work]
            return [c.model_copy(update={"sampling": h.sampling}) for c, h in
                    zip(R.claims_from(R.generate(R.engine_for(model), hot), hot), claims)]
        if kind == "logprobs":
            return [c.model_copy(update={"logprobs": [min(0.0, x + 0.3) for x in c.logprobs]}) for c in claims]
        if kind == "reward":
            return [c.model_copy(update={"reward": 1.0}) for c in claims if c.reward < 1]
        if kind == "early_stop":
            return [c.model_copy(update={"finish_reason": "length"}) for c in claims if c.finish_reason == "eos"]
        raise ValueError(kind)

    detection = {}
    for kind in ("noise1pct", "fp8", "int8", "prompt", "temperature_1.3", "logprobs", "reward", "early_stop"):
        cheats = cheat_claims(kind)
        ours_rej = [not v.accepted for v in verify_claims(cheats, ref)]
        theirs_rej = toploc_hidden_rejects(verify_proofs_bytes, cheats, ref)
        detection[kind] = {"n": len(cheats), "ours": round(sum(ours_rej) / len(cheats), 3),
                           "toploc": round(sum(theirs_rej) / len(cheats), 3)}
        log.info("tamper %-16s ours %.2f  toploc %.2f (n=%d)", kind, detection[kind]["ours"], detection[kind]["toploc"],
                 len(cheats))
    honest_toploc = toploc_hidden_rejects(verify_proofs_bytes, claims, ref)

    result = {
        "benchmark": "verification", "machine": "cpu-2core", "python": platform.python_version(), "torch": torch.__version__,
        "model": {"hidden": args.hidden, "layers": args.layers, "experts": 8, "dtype": "float32"},
        "rollouts": args.rollouts, "generated_tokens": n_tokens, "chunks": n_chunks,
        "proof_bytes_per_32_tokens": {"ours": len(ours[0][0][1]), "toploc": len(theirs[0][0])},
        "proofs_byte_identical_to_toploc": same,
        "build_ms_per_chunk": {"ours": round(1e3 * t_ours_build / n_chunks, 4), "toploc": round(1e3 * t_tl_build / n_chunks, 4)},
        "verify_ms_per_chunk": {"ours": round(1e3 * t_ours_verify / n_chunks, 4), "toploc": round(1e3 * t_tl_verify / n_chunks, 4)},
        "ratio_build_toploc_over_ours": round(t_tl_build / t_ours_build, 2),
        "ratio_verify_toploc_over_ours": round(t_tl_verify / t_ours_verify, 2),
        "generation_tok_per_s": round(n_tokens / t_gen, 1),
        "hidden_capture_overhead_share": round((t_gen - t_plain) / t_plain, 4),
        "proof_build_share_of_generation": round(t_prove / t_gen, 4),
        "verification_tok_per_s": round(n_tokens / t_verify, 1),
        "ratio_verification_over_generation_throughput": round(t_gen / t_verify, 2),
        "generation_tok_per_s_batch1": round(n_tokens / t_gen1, 1),
        "ratio_verification_over_generation_throughput_batch1": round(t_gen1 / t_verify, 2),
        "honest_false_rejections": {"ours": sum(not v.accepted for v in verdicts), "toploc": sum(honest_toploc)},
        "detection": detection,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
