"""Calibration from device data (issue 26, item 1): honest rollouts of the inference role's engine on a
device, judged by the validator role's path on that device and on the CPU; per precision the honest
worst of each path, the verdicts at the thresholds in force, and candidate thresholds with provenance.

    python -m benchmarks.verification_calibration --device cuda --results benchmarks/results/calibration-h200.json
    python -m benchmarks.verification_calibration --device cpu --shapes tiny --rounds 1:2,8:1 --results /tmp/c.json

Per (shape, precision) of the plan (`--shapes` x `--precisions`, then float32 at `--tf32-shape`): one
engine (benchmarks/device_rollouts.py: on CUDA `CudaEngine`, a graph per batch bucket up to 256, FP8
quantised on the GPU; float32 MoE decodes eagerly) serves rounds of `--rounds` (requests per round = the
decode batch: 1, 8, 64, 256), prompts of the reverse task, completions capped at 8, 24 or 48 tokens,
temperature 1.0 or 0.7 (by seed). The claims (routes attached) are judged by `verify_claims` and
measured along the validator's path (`cross_device_files.drift`: forced routes, sampled tokens, the
checked trimmed mean) by `TorchReference` on the device (`cuda`: every check on the GPU; float32 with TF32
off, `node.replay.exact_float32`) and on the CPU (`cpu`: a spread of `--cpu-rollouts` of them, or
`--cpu-rollouts-big` for models over 1B parameters); a float32 run is also judged on the GPU with TF32
on (`cuda_tf32`: what TF32 would cost). Candidates per precision: each bound max(in force, 1.5 x the
worst honest figure over the exact paths and shapes), with the path and shape that set it, and where they
were measured. Nothing here writes verification/calibration/thresholds.json: a person moves candidates
there. A case that would start after `--seconds` is recorded as skipped.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections import Counter
from dataclasses import asdict
from types import SimpleNamespace

import torch

from benchmarks import device_rollouts as D
from benchmarks.cross_device_files import drift
from verification.checks import THRESHOLDS
from verification.validator import verify_claims

log = logging.getLogger("bench.calibration_device")

LENGTHS = (8, 24, 48)
TEMPERATURES = (1.0, 0.7)
MARGIN = 1.5
"""Candidate bound = this x the honest worst (the cross-device widening's factor)."""
BOUND_OF = {"max_exp_mismatches": "exp_mismatches_max", "max_mant_err_mean": "mant_err_mean_max",
            "max_mant_err_median": "mant_err_median_max", "max_logprob_err": "logprob_err_max_max",
            "max_logprob_err_mean": "logprob_err_checked_mean_max", "margin_noise": "flip_margin_max_max"}
"""Each threshold and the honest figure it bounds (the mean bound applies to the trimmed mean)."""
EXACT_PATHS = ("cuda", "cpu")


def work_for(first: int, n: int) -> list:
    return [(s, D.R.spec(s, temperature=TEMPERATURES[s % 2], max_new_tokens=LENGTHS[s % 3]))
            for s in range(first, first + n)]


def honest_claims(base, fp8: str, args) -> tuple[list, dict]:
    eng = D.build_engine(base, fp8, args.device, max(b for b, _ in args.rounds), args.engine)
    facts = {"engine": f"{type(eng).__module__}.{type(eng).__name__}",
             "graphs": bool(getattr(eng, "use_graphs", False))}
    claims, seed, t = [], 1000, time.perf_counter()
    for batch, rounds in args.rounds:
        for _ in range(rounds):
            claims += D.claims_of(eng, work_for(seed, batch), base.config)
            seed += batch
    eng.close()
    return claims, {**facts, "generate_s": round(time.perf_counter() - t, 1)}


def judged_by(claims: list, ref) -> dict:
    t = time.perf_counter()
    verdicts = verify_claims(claims, ref)
    judge_s = time.perf_counter() - t
    return {"rollouts": len(claims), "rejected": sum(not v.accepted for v in verdicts),
            "reasons": dict(Counter(f"{v.reason.value}/{v.severity.value}" for v in verdicts if not v.accepted)),
            "details": [v.detail[:200] for v in verdicts if not v.accepted][:5], "judge_s": round(judge_s, 2),
            "honest_max": drift(SimpleNamespace(claims=claims), ref)["honest_max"]}


def calibrate_case(shape: str, precision: str, args) -> dict:
    dtype, fp8 = D.PRECISIONS[precision]
    base = D.random_model(shape, dtype, args.device)
    claims, facts = honest_claims(base, fp8, args)
    tokens = sum(sum(c.sampled_mask) for c in claims)
    out = {"shape": shape, "precision": precision, **facts, "rollouts": len(claims), "sampled_tokens": tokens,
           "rounds": [f"batch{b}x{r}" for b, r in args.rounds], "paths": {}}
    cuda = args.device.startswith("cuda")
    if cuda:
        ref = D.judge_reference({0: base}, fp8, args.device)
        out["paths"]["cuda"] = judged_by(claims, ref)
        if dtype == torch.float32:  # what TF32 in the validator's float32 matmuls would do
            saved, ref.exact_float32 = torch.backends.cuda.matmul.allow_tf32, False
            torch.backends.cuda.matmul.allow_tf32 = True
            try:
                out["paths"]["cuda_tf32"] = judged_by(claims, ref)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = saved
        del ref
        torch.cuda.empty_cache()
    cap = min(len(claims), args.cpu_rollouts if D.shape_facts(shape)["params"] < 1e9 else args.cpu_rollouts_big)
    step = max(1, len(claims) // cap)  # every batch's rollouts among those the CPU judges
    try:  # the device path's figures stand if the CPU's fail
        ref = D.judge_reference({0: base.to("cpu") if cuda else base}, fp8, "cpu")
        out["paths"]["cpu"] = judged_by(claims[::step][:cap], ref)
    except Exception as exc:
        log.exception("%s %s: the CPU path failed", shape, precision)
        out["paths"]["cpu"] = {"error": repr(exc)[:500]}
    log.info("%s %s: %d rollouts (%s, graphs %s) %s", shape, precision, len(claims), facts["engine"], facts["graphs"],
             {p: (r["rejected"], r["honest_max"]["exp_mismatches_max"], r["honest_max"]["logprob_err_checked_mean_max"],
                  r["honest_max"]["flip_margin_max_max"]) if "honest_max" in r else r for p, r in out["paths"].items()})
    return out


def candidates(cases: list[dict], provenance: dict | None = None) -> dict:
    """Per precision: each bound max(in force, MARGIN x the honest worst over the exact paths), which path
    and shape set it, and where it was measured (a record to paste beside the bounds in thresholds.json)."""
    out: dict[str, dict] = {}
    for precision in sorted({c["precision"] for c in cases if "paths" in c}):
        in_force = asdict(THRESHOLDS[precision])
        rows = [(c["shape"], path, r["honest_max"]) for c in cases if c.get("precision") == precision
                for path, r in c.get("paths", {}).items() if path in EXACT_PATHS and "honest_max" in r]
        if not rows:
            continue
        cand, set_by, needed = {}, {}, {}
        for bound, fig in BOUND_OF.items():
            shape, path, worst = max(rows, key=lambda r: r[2][fig])
            want = MARGIN * worst[fig]
            want = math.ceil(want) if isinstance(in_force[bound], int) else round(want, 4)
            needed[bound] = want
            cand[bound] = max(in_force[bound], want)
            set_by[bound] = (f"{path} judging at {shape}: {worst[fig]} x {MARGIN}" if want > in_force[bound]
                             else f"in force ({in_force[bound]}) covers {worst[fig]} x {MARGIN} ({path}, {shape})")
        prov = provenance or {}
        measured = {"device": prov.get("device_name"), "torch": prov.get("torch"), "cuda": prov.get("cuda"),
                    "triton": prov.get("triton"), "kernels": prov.get("kernels"),
                    "engines": sorted({f"{c['engine']} (graphs {'on' if c['graphs'] else 'off'})" for c in cases
                                       if c.get("precision") == precision and "engine" in c}),
                    "shapes": sorted({c["shape"] for c in cases if c.get("precision") == precision and "paths" in c}),
                    "paths": sorted({p for _, p, _ in rows}),
                    "rollouts": sum(c["rollouts"] for c in cases if c.get("precision") == precision and "paths" in c)}
        out[precision] = {"in_force": in_force, "needed": needed, "candidate": cand, "set_by": set_by,
                          "measured": measured,
                          "widened": sorted(b for b in BOUND_OF if cand[b] != in_force[b]),
                          "honest_rejected_in_force": {f"{s}/{p}": c["paths"][p].get("rejected") for c in cases
                                                       if c.get("precision") == precision for p in c.get("paths", {})
                                                       for s in [c["shape"]]}}
    return out


def plan_of(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(shape, precision) in order: each shape's precisions, float32 right after the TF32 shape's."""
    plan = []
    for s in args.shapes:
        plan += [(s, p) for p in args.precisions] + ([(s, "float32")] if s == args.tf32_shape else [])
    if args.tf32_shape and args.tf32_shape not in args.shapes:
        plan.append((args.tf32_shape, "float32"))
    return plan


def run(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    plan, cases = plan_of(args), []
    for shape, precision in plan:
        if time.perf_counter() - t0 > args.seconds:
            cases.append({"shape": shape, "precision": precision, "skipped": "out of time (--seconds)"})
            continue
        try:
            cases.append(calibrate_case(shape, precision, args))
        except Exception as exc:  # one device run measures what it can: a failing case is recorded, not fatal
            log.exception("%s %s failed", shape, precision)
            cases.append({"shape": shape, "precision": precision, "error": repr(exc)[:500]})
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        if args.results:  # what a run cut by an outer timeout measured
            with open(args.results, "w") as f:
                f.write(json.dumps(report(args, plan, cases, t0), indent=1) + "\n")
    return report(args, plan, cases, t0)


def report(args: argparse.Namespace, plan: list, cases: list[dict], t0: float) -> dict:
    return {"bench": "calibration_device", "command": "python -m benchmarks.verification_calibration "
            + " ".join(sys.argv[1:]), "provenance": D.provenance(args.device),
            "shapes": {s: D.shape_facts(s) for s in dict.fromkeys(s for s, _ in plan)},
            "seconds": round(time.perf_counter() - t0, 1), "margin": MARGIN,
            "candidates": candidates(cases, D.provenance(args.device)), "cases": cases,
            "note": "candidates only: verification/calibration/thresholds.json is not written by this run"}


def parse_rounds(text: str) -> list[tuple[int, int]]:
    """'1:8,8:4,64:1,256:1' -> [(batch, rounds), ...]."""
    return [(int(b), int(r)) for b, r in (x.split(":") for x in text.split(",") if x)]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default=None, help="calibrate from this device's engine (cuda, cuda:i, cpu): the "
                    "device path; writes --results only")
    ap.add_argument("--engine", choices=["builtin", "builtin-cuda"], default=None,
                    help="with --device: the engine (default: builtin-cuda on CUDA, builtin on the CPU)")
    ap.add_argument("--shapes", default="qwen3-moe-small,qwen3-30b-a3b-48l-e16,qwen3-moe-tiny",
                    help="with --device: device_rollouts.SHAPES, in order")
    ap.add_argument("--precisions", default="bfloat16,fp8-all-bfloat16,fp8-experts-bfloat16")
    ap.add_argument("--tf32-shape", default="qwen3-moe-small",
                    help="shape of the float32 case (TF32 on/off); '' skips it")
    ap.add_argument("--rounds", default="1:8,8:4,64:1,256:1", help="batch:rounds, comma-separated")
    ap.add_argument("--cpu-rollouts", type=int, default=64, help="rollouts the CPU path judges per case (a spread)")
    ap.add_argument("--cpu-rollouts-big", type=int, default=12, help="the same for models of over 1B parameters")
    ap.add_argument("--seconds", type=float, default=170.0, help="start no case after this long (the rest: skipped)")
    ap.add_argument("--results", default=None, help="with --device: write the JSON here")


def main_device(args: argparse.Namespace) -> int:
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.precisions = [p for p in args.precisions.split(",") if p]
    unknown = [s for s in args.shapes + [args.tf32_shape] if s and s not in D.SHAPES] + \
        [p for p in args.precisions if p not in D.PRECISIONS]
    if unknown:
        raise SystemExit(f"unknown shapes or precisions: {unknown} (device_rollouts.SHAPES, PRECISIONS)")
    args.rounds = parse_rounds(args.rounds)
    args.engine = args.engine or D.default_engine(args.device)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    result = run(args)
    if args.results:
        with open(args.results, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0
