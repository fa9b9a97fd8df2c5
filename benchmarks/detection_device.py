"""Detection per submission on a device: tampered engines judged by the validator role's path, beside the
honest engine that must pass (issue 26, item 4).

    python -m benchmarks.detection_device --device cuda [--rollouts 256] [--out ...-h200.json]
    python -m benchmarks.detection_device --device cpu --shape tiny --rollouts 16   # a tiny run

Per run precision (`--precisions`: bf16, FP8 experts and FP8 all on a bf16 base), the engine is the
inference role's (benchmarks/device_rollouts.py: `CudaEngine` with graphs on CUDA) and the judge the
validator's (`TorchReference` on `--device`, `verify_claims`), which knows versions 0 and 1 (1 = 0 plus
1% of each tensor's std, a policy step). Cases, each `--rollouts` rollouts (one submission each) at
engine batch `--batch`:
- `honest`: version 0 served as the run prescribes (must pass);
- `noise1pct/all`, `noise1pct/layer0`, `noise0.1pct/all`, `noise0.1pct/layer0`: Gaussian noise of 1% /
  0.1% of each tensor's std on every layer / on layer 0 (norms untouched), then served as prescribed;
- `int8`: weights rounded to int8 per row, then served as prescribed;
- `fp8_engine` (bf16 runs): the node's block-scaled FP8 engine (all projections) claiming the bf16 run;
- `plain_engine` (FP8 runs): the unquantised bf16 engine claiming the FP8 run;
- `stale_version`: version 0's rollouts claimed as version 1 (proofs relabelled).
`benchmarks.weak_tamper` is the CPU sweep over noise sizes; `verification_calibration` scores tampers
by the figures alone. Prints progress, then one JSON line: the rejected share per case (proof-grade and
borderline apart) and the reasons; the peer is the honest case of the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks import device_rollouts as D, emit
from benchmarks import weak_tamper
from verification.checks import THRESHOLDS
from verification.pooled import POOLED_DETAIL, bounds_for, shape_of

log = logging.getLogger("bench.detection_device")

VERSION_STEP = 1e-2
"""Version 1 is version 0 plus noise of this share of each tensor's std."""
NOISE = {"noise1pct": 1e-2, "noise0.1pct": 1e-3}


def cases_for(precision: str) -> list[str]:
    """The cases of a run of `precision`, the aims' first (a run out of time skips the last)."""
    fp8 = D.PRECISIONS[precision][1]
    return ["honest", "noise1pct/all", "plain_engine" if fp8 != "off" else "fp8_engine", "noise0.1pct/all", "int8",
            "stale_version", "noise1pct/layer0", "noise0.1pct/layer0"]


def engine_for(case: str, base, fp8: str, args):
    """The engine (policy version 0) of a node running `case` in a run of FP8 mode `fp8`."""
    kind, _, scope = case.partition("/")
    if kind in NOISE:
        return D.build_engine(D.noisy(base, NOISE[kind], scope), fp8, args.device, args.batch, args.engine)
    if kind == "int8":
        return D.build_engine(D.rounded(base, "int8"), fp8, args.device, args.batch, args.engine)
    if kind == "fp8_engine":
        return D.build_engine(base, "all", args.device, args.batch, args.engine)
    if kind == "plain_engine":
        return D.build_engine(base, "off", args.device, args.batch, args.engine)
    return D.build_engine(base, fp8, args.device, args.batch, args.engine)  # honest, stale_version


def case_claims(case: str, precision: str, base, ref, args) -> list:
    """`--rollouts` claims of `case`, every `--group` consecutive ones one submission (a shared work id)."""
    work = [(s, D.R.spec(s, max_new_tokens=args.new_tokens)) for s in range(5000, 5000 + args.rollouts)]
    eng = engine_for(case, base, D.PRECISIONS[precision][1], args)
    claims = D.claims_of(eng, work, base.config)
    eng.close()
    del eng  # its model (a tampered copy) and graphs: a 5.2B shape's last cases ran out of an H100's memory
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    claims = D.relabel(claims, 1, ref.hidden_size) if case == "stale_version" else claims
    return [c.model_copy(update={"work_id": 5000 + i // args.group}) for i, c in enumerate(claims)]


def judged(claims, ref, evidence_to=None, tags: dict | None = None) -> dict:
    """weak_tamper.judged per rollout, and per submission (a work id: rejected when any claim of it is);
    each claim's evidence appended to `evidence_to` (a file) as one JSON line with `tags`."""
    evidence: list = []
    out = weak_tamper.judged(claims, ref, details=3, evidence=evidence)
    units: dict[int, bool] = {}
    verdicts = out.pop("verdicts")
    for c, v in zip(claims, verdicts):
        units[c.work_id] = units.get(c.work_id, False) or not v.accepted
    out["submissions"] = len(units)
    out["submissions_rejected"] = round(sum(units.values()) / max(1, len(units)), 4)
    if evidence_to is not None:
        with open(evidence_to, "a") as f:
            for c, e, v in zip(claims, evidence, verdicts):
                f.write(json.dumps({**(tags or {}), "work_id": c.work_id, "tokens_claimed": len(c.token_ids),
                                    "passed_alone": v.accepted or v.detail.startswith(POOLED_DETAIL),
                                    **asdict(e)}) + "\n")
    return out


def run(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    precisions = [p for p in args.precisions.split(",") if p]
    bases, refs, out = {}, {}, {p: {} for p in precisions}
    for precision in precisions:
        dtype, fp8 = D.PRECISIONS[precision]
        bases[precision] = D.random_model(args.shape, dtype, args.device, positions=args.max_seq)
        refs[precision] = D.judge_reference({0: bases[precision], 1: D.noisy(bases[precision], VERSION_STEP, "all",
                                                                             seed=7)}, fp8, args.device)
        assert refs[precision].precision == precision, refs[precision].precision
    for i in range(len(cases_for(precisions[0]))):  # case by case across precisions: time runs out evenly
        for precision in precisions:
            case, base, ref = cases_for(precision)[i], bases[precision], refs[precision]
            if args.cases and case.partition("/")[0] not in args.cases and case not in args.cases:
                continue
            if time.perf_counter() - t0 > args.seconds:
                out[precision][case] = {"skipped": "out of time (--seconds)"}
                continue
            t = time.perf_counter()
            try:
                tags = {"precision": precision, "case": case, "shape": args.shape, "engine_device": args.device,
                        "judge_device": args.device, "batch": args.batch}
                out[precision][case] = {**judged(case_claims(case, precision, base, ref, args), ref, args.evidence,
                                                 tags), "seconds": round(time.perf_counter() - t, 1)}
            except Exception as exc:  # one device run measures what it can: a failing case is recorded
                log.exception("%s %s failed", precision, case)
                out[precision][case] = {"error": repr(exc)[:500]}
            log.info("%-22s %-20s %s", precision, case,
                     {k: v for k, v in out[precision][case].items() if k != "details"})
            if args.out:  # what a run cut by an outer timeout measured
                args.out.write_text(json.dumps(report(args, out, t0), indent=1) + "\n")
    return report(args, out, t0)


def report(args: argparse.Namespace, out: dict, t0: float) -> dict:
    rate = {p: {c: r.get("submissions_rejected") for c, r in cases.items()} for p, cases in out.items()}
    return {"bench": "detection_device", "command": "python -m benchmarks.detection_device " + " ".join(sys.argv[1:]),
            "device": args.device, "engine": args.engine, "shape": D.shape_facts(args.shape),
            "provenance": D.provenance(args.device), "rollouts_per_case": args.rollouts, "engine_batch": args.batch,
            "rollouts_per_submission": args.group, "max_seq": args.max_seq, "new_tokens": args.new_tokens,
            "pooled": {p: asdict(b) for p in out  # the bounds its longest possible claims meet
                       if (b := bounds_for(p, shape_of(D.config_of(args.shape)), args.max_seq))},
            "seconds": round(time.perf_counter() - t0, 1),
            "honest_rejected": {p: r.get("honest") for p, r in rate.items()},
            "detection": {p: {c: v for c, v in r.items() if c != "honest"} for p, r in rate.items()},
            "aims": aims(rate), "thresholds": {p: asdict(THRESHOLDS[p]) for p in out}, "cases": out}


def aims(rate: dict) -> dict:
    """Issue 26's detection aims, per submission, where this run measured them (None: not measured)."""
    def at_least(precision: str, case: str, share: float) -> bool | None:
        got = rate.get(precision, {}).get(case)
        return None if got is None else got >= share

    return {"noise1pct/all >= 0.99, bfloat16": at_least("bfloat16", "noise1pct/all", 0.99),
            "noise1pct/all >= 0.99, fp8-all-bfloat16": at_least("fp8-all-bfloat16", "noise1pct/all", 0.99),
            **{f"plain_engine >= 0.90, {p}": at_least(p, "plain_engine", 0.90) for p in rate if p.startswith("fp8-")}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:i: where engines serve and the validator judges")
    ap.add_argument("--engine", choices=["builtin", "builtin-cuda"], default=None,
                    help="the inference role's engine (default: builtin-cuda on CUDA, builtin on the CPU)")
    ap.add_argument("--shape", default=None, choices=list(D.SHAPES),
                    help="device_rollouts.SHAPES (default: qwen3-moe-small on CUDA, tiny on the CPU)")
    ap.add_argument("--precisions", default="bfloat16,fp8-all-bfloat16,fp8-experts-bfloat16")
    ap.add_argument("--rollouts", type=int, default=256, help="rollouts per case")
    ap.add_argument("--group", type=int, default=8, help="rollouts per submission (a work unit's group; the run's "
                    "group size): detection is per submission, the pooled check judges its rollouts together")
    ap.add_argument("--cases", type=lambda x: [c for c in x.split(",") if c], default=[],
                    help="only these cases (names or kinds, e.g. honest,noise1pct); default all")
    ap.add_argument("--evidence", type=Path, default=None, help="append each claim's evidence here (JSON lines; "
                    "python -m benchmarks.pooled_calibration reads them)")
    ap.add_argument("--batch", type=int, default=64, help="engine batch (slots)")
    ap.add_argument("--seconds", type=float, default=170.0, help="start no case after this long (the rest: skipped)")
    ap.add_argument("--max-seq", type=int, default=D.R.MAX_SEQ, help="sequence limit, prompt + completion (the "
                    "harness's 64 by default; the network's rollouts run to ~1,000 tokens)")
    ap.add_argument("--new-tokens", type=int, default=40, help="completion limit of each rollout")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if unknown := [p for p in args.precisions.split(",") if p and p not in D.PRECISIONS]:
        ap.error(f"unknown precisions {unknown}; known: {', '.join(D.PRECISIONS)}")
    args.engine = args.engine or D.default_engine(args.device)
    args.shape = args.shape or ("qwen3-moe-small" if args.device.startswith("cuda") else "tiny")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    return emit(run(args), args.out)


if __name__ == "__main__":
    sys.exit(main())
