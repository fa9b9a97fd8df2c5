"""Honest variation of routed experts: `python -m benchmarks.route_calibration [--rollouts N]`.

The engine routes each position while it generates (batched prefill of the prompt, then KV-cached
decode steps next to other sequences, continuous batching at 1..32); the validator routes the same
positions in one prefill of the whole sequence, alone or batched with others. Per rollout this
measures the share of (position, MoE layer) pairs whose top-k sets differ, for float32 and bfloat16
engines (each against the validator in its own precision), and, for scale, the same share for a
tampered engine (1% weight noise) and for a rollout's routes claimed under a version one noisy step
away. Writes verification/calibration/routing.json; verification/routing.py's thresholds bound the
honest maxima. It lives here, not in `verification`, because it drives the node's engine
(`verification` imports nothing from `node`: tests/test_import_rules.py).

`--fp8`: the same for FP8 runs (`fp8-<experts|all>-<float32|bfloat16>`): engine and validator both
quantised by `apply_fp8_mode` (CPU reference GEMM; the router gate itself stays in the base dtype), plus
the largest router-logit difference between KV-cached decode and one prefill (the delta `ROUTER_TIE`
bounds); writes verification/calibration/routing-fp8.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from benchmarks.verification_calibration import _harness
from node.engine import Engine
from protocol.model_spec import FP8_MODES
from verification.calibration.perturb import perturb
from verification.routing import FALSE_REJECT_RATE, HONEST_PAIR_RATE, ROUTER_TIE, evidence_needed, mismatched_pairs

HERE = Path(__file__).resolve().parents[1] / "verification" / "calibration"
log = logging.getLogger("calibrate.routing")


def shares(R, engine_model, ref, seeds: list[int], max_batch: int, threads: int) -> list[tuple[int, int]]:
    """Per rollout: (pairs whose engine top-k set differs from the reference's, (position, layer) pairs)."""
    torch.set_num_threads(threads)
    work = [(s, R.spec(s)) for s in seeds]
    engine = Engine(engine_model, max_batch=max_batch, max_seq_len=R.MAX_SEQ, eos_id=R.TOK.eos_id,
                    decode=R.TOK.decode, capture_experts=True)
    comps = R.generate(engine, work)
    torch.set_num_threads(2)
    outs = ref.prefill(0, [c.prompt_ids + c.token_ids[:-1] for c in comps], with_routes=True)
    return [(int(mismatched_pairs(c.routed_experts, routes).sum()), routes.shape[0] * routes.shape[1])
            for c, (_, _, routes) in zip(comps, outs)]


def summary(rows: list[tuple[int, int]]) -> dict:
    share = [bad / pairs for bad, pairs in rows]
    return {"rollouts": len(rows), "pairs": sum(p for _, p in rows), "mismatched_pairs": sum(b for b, _ in rows),
            "max_share": round(max(share), 5), "mean_share": round(sum(share) / len(rows), 6),
            "rollouts_with_any": sum(b > 0 for b, _ in rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=64, help="rollouts per variation")
    ap.add_argument("--out", type=Path, default=None, help="default: routing.json (routing-fp8.json with --fp8)")
    ap.add_argument("--fp8", action="store_true", help="calibrate the FP8 precisions instead")
    ap.add_argument("--batched-only", action="store_true",
                    help="only the validator's batched prefill (bf16 showed no difference from one sequence at a time)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    R = _harness()
    models = {"float32": R.tiny_model(), "bfloat16": R.tiny_model(dtype=torch.bfloat16)}
    spread = {}
    if args.fp8:
        import copy

        from benchmarks.weak_tamper import router_logit_spread
        from node.engine.fp8.model import apply_fp8_mode

        models = {f"fp8-{mode}-{dtype}": apply_fp8_mode(copy.deepcopy(m), mode)
                  for dtype, m in models.items() for mode in FP8_MODES if mode != "off"}
        spread = {p: {f"threads{t}": router_logit_spread(m, t) for t in (1, 2)} for p, m in models.items()}
        log.info("router logit spread %s", spread)
    args.out = args.out or HERE / ("routing-fp8.json" if args.fp8 else "routing.json")
    seeds = list(range(2000, 2000 + args.rollouts))
    cases: dict[str, dict] = {}
    honest: dict[str, list[tuple[int, int]]] = {p: [] for p in models}
    for precision, model in models.items():
        for batch_tokens in (65_536, 1) if not args.batched_only else (65_536,):  # validator's prefill batched or alone
            ref = R.reference({0: model})
            ref.batch_tokens = batch_tokens
            for max_batch in (1, 8, 32):
                for threads in (1, 2):
                    name = f"honest/{precision}/engine_batch{max_batch}/threads{threads}/validator_" \
                           f"{'batched' if batch_tokens > 1 else 'alone'}"
                    t = time.perf_counter()
                    rows = shares(R, model, ref, seeds, max_batch, threads)
                    honest[precision] += rows
                    cases[name] = summary(rows)
                    log.info("%-72s %s (%.1fs)", name, cases[name], time.perf_counter() - t)
        ref = R.reference({0: model})
        for name, engine_model in ((("tamper/noise1pct", perturb(model, "noise1pct")),
                                    ("other_version/noise1pct_step", perturb(model, "noise1pct", seed=7)))
                                   if not args.fp8 else ()):
            cases[f"{name}/{precision}"] = summary(shares(R, engine_model, ref, seeds, 32, 2))
            log.info("%-72s %s", f"{name}/{precision}", cases[f"{name}/{precision}"])
    result = {"command": f"python -m benchmarks.route_calibration --rollouts {args.rollouts}"
                         + (" --fp8" if args.fp8 else "") + (" --batched-only" if args.batched_only else ""),
              "router_logit_spread": spread,
              "torch": torch.__version__,
              "honest": {p: summary(rows) for p, rows in honest.items()},
              "in_force": {"honest_pair_rate": HONEST_PAIR_RATE, "router_tie": ROUTER_TIE,
                           "false_reject_rate": FALSE_REJECT_RATE},
              # every differing pair counted as evidence (near-ties too): an upper bound
              "honest_rejected": {p: sum(b >= evidence_needed(n, HONEST_PAIR_RATE[p]) for b, n in rows)
                                  for p, rows in honest.items() if p in HONEST_PAIR_RATE},
              "cases": cases}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("honest", "in_force", "honest_rejected")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
