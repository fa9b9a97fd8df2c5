"""How much logits memory a validator's round holds on a real vocabulary, and what the prefill costs.

    python -m benchmarks.validator_logits [--model smollm2-135m-instruct] [--rollouts 64]

Generates honest reverse-text rollouts with the built-in engine, then prefills them as a validator does:
the peer is the full prefill (every position's [T, V] float32 logits handed back, as the validator did
before: views into each batch's logits, all alive until the round's checks end); ours asks only for the
completion rows and checks the round in groups under `PREFILL_LOGITS_BYTES`. Ends with one JSON line:
bytes held by each, prefill seconds of each, and the verdicts of the round (all must be accepted).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import time

import torch

from node.engine import Engine, Request, SamplingParams
from node.model.spec import ModelSpec, load_model
from node.replay import TorchReference, env_oracle
from verification.claim import RolloutClaim, SamplingSpec
from verification.proof import prove_rollouts
from verification import validator
from verification.validator import verify_claims

log = logging.getLogger("benchmarks.validator_logits")
ENV = "reverse-text"
MANIFEST = hashlib.sha256(b"v0").digest()


def held_bytes(outs) -> int:
    """Bytes of the distinct storages the returned logits keep alive."""
    return sum({o[0].untyped_storage().data_ptr(): o[0].untyped_storage().nbytes() for o in outs}.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=128)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    loaded = load_model(ModelSpec(source=args.model, dtype="float32", max_seq_len=args.max_seq_len))
    model, tok = loaded.model, loaded.tokenizer
    prompt_ids, reward = env_oracle(tok)
    work = [(s, SamplingSpec(temperature=1.0, max_new_tokens=32, seed=s)) for s in range(args.rollouts)]
    log.info("generating %d rollouts", len(work))
    engine = Engine(model, max_batch=32, max_seq_len=args.max_seq_len, eos_id=tok.eos_id, decode=tok.decode,
                    capture_hidden=True)
    comps = engine.generate([Request(f"w{s}", prompt_ids(ENV, s), SamplingParams(
        temperature=sp.temperature, max_new_tokens=sp.max_new_tokens, seed=sp.seed)) for s, sp in work])
    proofs = prove_rollouts([(c.hidden, c.versions) for c in comps], {0: MANIFEST})
    claims = [RolloutClaim(work_id=s, env=ENV, task_seed=s, prompt_ids=c.prompt_ids, token_ids=c.token_ids,
                           logprobs=c.logprobs, versions=c.versions, sampling=sp, finish_reason=c.finish_reason,
                           reward=reward(ENV, s, c.token_ids), proof=p) for c, (s, sp), p in zip(comps, work, proofs)]
    ref = TorchReference({0: (model, MANIFEST)}, eos_id=tok.eos_id, max_seq_len=args.max_seq_len,
                         decode=tok.decode, tasks=prompt_ids, reward=reward)
    seqs = [c.prompt_ids + c.token_ids[:-1] for c in claims]
    starts = [len(c.prompt_ids) - 1 for c in claims]

    t0 = time.perf_counter()
    full = ref.prefill(0, seqs)
    full_s, full_held = time.perf_counter() - t0, held_bytes(full)
    del full
    t0 = time.perf_counter()
    part = ref.prefill(0, seqs, logits_from=starts)
    part_s = time.perf_counter() - t0
    del part
    groups: list[int] = []
    prefill = ref.prefill

    def recording(*a, **k):
        out = prefill(*a, **k)
        groups.append(held_bytes(out))
        return out

    ref.prefill = recording
    t0 = time.perf_counter()
    verdicts = verify_claims(claims, ref)
    verify_s = time.perf_counter() - t0
    result = {"benchmark": "validator_logits", "model": args.model, "vocab": ref.vocab_size, "rollouts": len(claims),
              "tokens_total": sum(len(s) for s in seqs), "completion_tokens": sum(len(c.token_ids) for c in claims),
              "peer_full_logits_held_mib": round(full_held / 2**20, 1),
              "ours_max_group_held_mib": round(max(groups) / 2**20, 1), "groups": len(groups),
              "budget_mib": validator.PREFILL_LOGITS_BYTES / 2**20,
              "ratio_held_peer_over_ours": round(full_held / max(groups), 2),
              "peer_prefill_s": round(full_s, 2), "ours_prefill_s": round(part_s, 2),
              "ratio_prefill_peer_over_ours": round(full_s / part_s, 2), "verify_s": round(verify_s, 2),
              "accepted": sum(v.accepted for v in verdicts), "threads": torch.get_num_threads()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
