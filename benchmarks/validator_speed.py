"""How fast the validator role judges, against the inference role's engine generating the same rollouts
on the same device (issue 24's `verify_over_generate`, measured on the roles' code alone).

    python -m benchmarks.validator_speed [--device cuda] [--shape qwen3-30b-a3b-8l] [--dtype bfloat16] [--rollouts 512]
        [--round 128] [--group 8] [--profile FILE] [--new-tokens 1000 --lengths pareto]

The engine is the inference role's (`benchmarks.device_rollouts.build_engine`: `CudaEngine` with its
graphs on a GPU, `Engine` on the CPU), generating `--rollouts` honest rollouts of the reverse task at its
`--batch` slots (completions of `--new-tokens`, or heavy-tailed lengths up to it with `--lengths pareto`); the judge is the validator role's: `TorchReference` over `ResidentPolicies` (one resident
model) and `verify_claims`, in rounds of `--round` claims, `--group` claims a submission, as
`ValidatorNode._judge` hands them over. The peer is the engine's own batched GPU prefill
(`node.engine.verify.verify_prefill`) over the same sequences: the forward pass with nothing checked,
what the judging could approach. Figures: generation tok/s (completion tokens over the engine's
seconds), judging tok/s (prompt + completion tokens recomputed over the rounds' seconds, as the role's
rounds count them), the ratio of the two, milliseconds per claim, the share of judging spent in the
reference's prefill, the garbage collector's seconds inside the timed judging rounds and generation (`gc_s`,
`gen_gc_s`: a full pass over the process's heap lands in one or the other, or neither, by the allocations before
it; the `_without_gc` figures leave them out), and every verdict (all must be accepted). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import io
import logging
import pstats
import sys
import time
from pathlib import Path

import torch

import benchmarks.device_rollouts as D
from benchmarks import emit
from node.engine.sampling import SamplingParams
from node.engine.verify import verify_prefill
from node.heap import Collections
from node.replay import TorchReference, env_oracle
from node.roles.resident_policy import ResidentPolicies
from verification.validator import verify_claims

log = logging.getLogger("benchmarks.validator_speed")
R = D.R


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def role_reference(model, device: str) -> TorchReference:
    """The validator role's reference (`ValidatorNode._judge`): one resident model, the role's budget rules."""
    prompt_ids, reward = env_oracle(R.TOK)
    policies = ResidentPolicies(copy.deepcopy(model).to(device).eval(), 0, R.manifest(0))
    return TorchReference(policies, eos_id=R.TOK.eos_id, max_seq_len=model.config.max_position_embeddings,
                          decode=R.TOK.decode,
                          tasks=prompt_ids, reward=reward)


class _Timed:
    """Seconds a reference spends in its prefill (synchronised on a GPU, so kernels count where they ran)."""

    def __init__(self, ref: TorchReference, device: str):
        self.ref, self.device, self.seconds = ref, device, 0.0
        self._prefill = ref.prefill

        def prefill(*args, **kwargs):
            _sync(device)
            t = time.perf_counter()
            out = self._prefill(*args, **kwargs)
            _sync(device)
            self.seconds += time.perf_counter() - t
            return out

        ref.prefill = prefill


def completion_lengths(n: int, most: int, tail: str, seed: int = 0) -> list[int]:
    """Each rollout's completion limit: `most` for all ("fixed"), or heavy-tailed ("pareto": 16 x (1 + a Lomax
    draw of shape 1.2), 8 to `most`: most completions a few dozen tokens, a few up to `most`, as RL answers of
    varying length are; the random model rarely says EOS, so each runs to its limit)."""
    if tail == "fixed":
        return [most] * n
    import numpy as np

    draws = 16 * (1 + np.random.default_rng(seed).pareto(1.2, size=n))
    return [int(x) for x in np.clip(np.rint(draws), 8, most)]


def run(args: argparse.Namespace) -> dict:
    positions = max(R.MAX_SEQ, args.new_tokens + 24)  # the harness's prompts fit in 24 positions (64 - its 40)
    model = D.random_model(args.shape, getattr(torch, args.dtype), args.device, positions=positions)
    cfg = model.config
    lengths = completion_lengths(args.rollouts, args.new_tokens, args.lengths)
    work = [(s, R.spec(s, max_new_tokens=n)) for s, n in zip(range(7000, 7000 + args.rollouts), lengths)]
    engine = D.build_engine(model, "off", args.device, args.batch)
    R.generate(engine, work[: args.batch])  # warm: the graphs' first replays, the allocator
    _sync(args.device)
    gen_collections = Collections()
    t = time.perf_counter()
    gen_collections.on = True
    comps = R.generate(engine, work)
    _sync(args.device)
    gen_collections.on = False
    gen_s = time.perf_counter() - t
    gen_collections.close()
    engine.close()
    claims = D.claims_from_completions(comps, work, cfg)
    claims = [c.model_copy(update={"work_id": 7000 + i // args.group}) for i, c in enumerate(claims)]
    completion_tokens = sum(len(c.token_ids) for c in claims)
    sequence_tokens = sum(len(c.prompt_ids) + len(c.token_ids) for c in claims)

    ref = role_reference(model, args.device)
    if args.settle_heap:  # as the validator role does once it holds its first version
        from node.heap import settle_heap

        settle_heap()
    t = time.perf_counter()
    gc.collect()  # what one full pass costs this process now (a pass lands in a round or not, by the allocations)
    full_pass_s = time.perf_counter() - t
    timed = _Timed(ref, args.device)
    verify_claims(claims[: args.round], ref)  # warm
    timed.seconds = 0.0
    rounds = [claims[i : i + args.round] for i in range(0, len(claims), args.round)]
    verdicts, judge_s = [], 0.0
    collections = Collections()
    for round_claims in rounds:
        _sync(args.device)
        t = time.perf_counter()
        collections.on = True
        verdicts += verify_claims(round_claims, ref)
        _sync(args.device)
        collections.on = False
        judge_s += time.perf_counter() - t
    collections.close()
    profile_top = None
    if args.profile:  # a round judged again under the profiler, after the timed ones: its overhead is not timed
        # (a profiled round inside the timing read 1.543 against 1.414-1.428 ms a claim on the 2-core CPU)
        profiler = cProfile.Profile()
        profiler.enable()
        verify_claims(rounds[len(rounds) // 2], ref)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        args.profile.write_text(text.getvalue())
        profile_top = args.profile.name
    kernels = None
    if args.kernels:  # where one round's GPU time goes (torch.profiler, after the timed rounds: not in their time)
        from benchmarks.gpu_engine import profiled

        kernels = profiled(lambda: verify_claims(rounds[len(rounds) // 2], ref), steps=1, top=25)

    # the peer: the engine's batched prefill over the same sequences, nothing checked
    seqs = [c.prompt_ids + c.token_ids for c in claims]
    plens = [len(c.prompt_ids) for c in claims]
    params = [SamplingParams(temperature=c.sampling.temperature, top_p=c.sampling.top_p, seed=c.sampling.seed)
              for c in claims]
    resident = ref.policies[0][0]
    verify_prefill(resident, seqs[: args.round], plens[: args.round], params[: args.round])  # warm
    _sync(args.device)
    t = time.perf_counter()
    for i in range(0, len(seqs), args.round):
        verify_prefill(resident, seqs[i : i + args.round], plens[i : i + args.round], params[i : i + args.round])
    _sync(args.device)
    peer_s = time.perf_counter() - t

    gen_tok_s = completion_tokens / gen_s
    judge_tok_s = sequence_tokens / judge_s
    facts = D.shape_facts(args.shape)
    return {
        "bench": "validator_speed", "settle_heap": args.settle_heap, "gc_full_pass_s": round(full_pass_s, 4),
        "command": "python -m benchmarks.validator_speed " + " ".join(sys.argv[1:]),
        "provenance": D.provenance(args.device), "shape": facts["name"], "params_b": round(facts["params"] / 1e9, 3),
        "vocab": cfg.vocab_size, "dtype": args.dtype, "rollouts": len(claims), "round_claims": args.round,
        "lengths": args.lengths, "max_seq": cfg.max_position_embeddings,
        "completion_tokens_p50_max": [sorted(len(c.token_ids) for c in claims)[len(claims) // 2],
                                      max(len(c.token_ids) for c in claims)],
        "group": args.group, "engine_batch": args.batch, "completion_tokens": completion_tokens,
        "sequence_tokens": sequence_tokens,
        "gen_s": round(gen_s, 3), "gen_tok_s": round(gen_tok_s, 1),
        "judge_s": round(judge_s, 3), "judge_tok_s": round(judge_tok_s, 1),
        "judge_completion_tok_s": round(completion_tokens / judge_s, 1),
        "verify_over_generate": round(judge_tok_s / gen_tok_s, 3),
        "verify_over_generate_completion": round(completion_tokens / judge_s / gen_tok_s, 3),
        "ms_per_claim": round(1000 * judge_s / len(claims), 3),
        "prefill_share": round(timed.seconds / judge_s, 3),
        "gc_s": round(collections.seconds, 3), "gc_full_passes": collections.full,
        "ms_per_claim_without_gc": round(1000 * (judge_s - collections.seconds) / len(claims), 3),
        "gen_gc_s": round(gen_collections.seconds, 3), "gen_gc_full_passes": gen_collections.full,
        "verify_over_generate_without_gc": round((sequence_tokens / (judge_s - collections.seconds))
                                                 / (completion_tokens / (gen_s - gen_collections.seconds)), 3),
        "peer_prefill_s": round(peer_s, 3), "peer_prefill_tok_s": round(sequence_tokens / peer_s, 1),
        "judge_over_peer_prefill": round(peer_s / judge_s, 3),
        "accepted": sum(v.accepted for v in verdicts), "rejected": sum(not v.accepted for v in verdicts),
        "rejections": sorted({f"{getattr(v.reason, 'value', v.reason)}: {v.detail[:80]}" for v in verdicts
                              if not v.accepted})[:5],
        "profile": profile_top, "round_kernels": kernels,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:i: where the engine serves and the validator judges")
    ap.add_argument("--shape", default=None, choices=list(D.SHAPES), help="default: qwen3-30b-a3b-8l on a GPU, tiny on the CPU")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="the run's dtype (float32: what `sim` runs the tiny model in, on a GPU without CUDA graphs)")
    ap.add_argument("--rollouts", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=40, help="completion tokens at most (the harness's positions: 64)")
    ap.add_argument("--lengths", choices=["fixed", "pareto"], default="fixed",
                    help="every completion up to --new-tokens, or heavy-tailed limits up to it (completion_lengths)")
    ap.add_argument("--batch", type=int, default=256, help="engine slots")
    ap.add_argument("--round", type=int, default=128, help="claims one judging round takes (the role: 16 units of 8)")
    ap.add_argument("--group", type=int, default=8, help="claims of one submission (a work unit)")
    ap.add_argument("--profile", type=Path, default=None, help="cProfile of one round, the top 40 by cumulative time")
    ap.add_argument("--kernels", action="store_true",
                    help="one round again under torch.profiler: its top kernels by GPU time (round_kernels)")
    ap.add_argument("--no-settle-heap", dest="settle_heap", action="store_false",
                    help="leave the collector as it is (the role calls node.heap.settle_heap once its model is held)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    args.shape = args.shape or ("qwen3-30b-a3b-8l" if args.device.startswith("cuda") else "tiny")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    return emit(run(args), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
