"""Re-derive the verification thresholds: `python -m benchmarks.verification_calibration`.

Generates honest rollouts of the tiny test model under every variation an honest node may run
(batch size 1..32 with continuous batching, 1 or 2 threads, and, per engine precision, the
KV-cached decode against the validator's prefill in that precision), measures them, does the same
for tampered engines (1% weight noise, fp8 and int8 weight rounding, a bf16 engine claiming
float32), and writes verification/calibration/`data.json` (one row per rollout) and `thresholds.json`
(honest maxima per precision, the thresholds in force, and the share of tampered rollouts they
reject). tests/verification/test_calibration.py holds the thresholds in force above the honest
maxima.

`--fp8` calibrates the FP8 precisions instead (`fp8-<experts|all>-<float32|bfloat16>`: the run's
`model.fp8` on its dtype): engine and reference both quantised by `apply_fp8_mode`, on the CPU path
(`reference_gemm`); honest variation = batch 1/8/32 x 1/2 threads x KV-cached decode against prefill;
tampers: 1% weight noise and int8 rounding before quantisation, and an unquantised engine claiming the
FP8 run (`plain_engine`). It writes `data-fp8.json` and merges its precisions into `thresholds.json`.
GPU FP8 kernels (Triton, DeepGEMM) against this CPU reference are not part of it (no GPU measured).
`--rescore` recomputes the summary from the data file (`data.json`, or `data-fp8.json` with `--fp8`) with the
thresholds in force (after editing them), keeping what other paths recorded per precision (`cross_device`).
`--device cuda|cpu` is the device path instead (benchmarks/calibration_device.py): the CUDA engine's honest
rollouts (bf16, FP8 experts, FP8 all; graphs on; batches 1 to 256; several shapes) judged by the validator's
GPU path and its CPU path, candidates with provenance written to `--results`, never to thresholds.json.
It lives here, not in `verification`, because it drives the node's engine through the test
harness (`verification` imports nothing from `node`).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from protocol.model_spec import FP8_MODES
from verification.calibration.measure import FIELDS, RolloutFigures, measure, summarize
from verification.calibration.perturb import perturb
from verification.checks import THRESHOLDS, Thresholds

HERE = Path(__file__).resolve().parents[1] / "verification" / "calibration"
log = logging.getLogger("calibrate")


def _harness():
    sys.path.insert(0, str(HERE.parents[1] / "tests" / "verification"))
    import rollouts  # the shared test harness: tiny model, engine, claims

    return rollouts


def rejected_by(r: RolloutFigures, t: Thresholds) -> bool:
    """Whether the recomputation checks would reject a rollout with these figures."""
    return (r.exp_mismatches > t.max_exp_mismatches or r.mant_err_mean > t.max_mant_err_mean
            or r.mant_err_median > t.max_mant_err_median or r.logprob_err_max > t.max_logprob_err
            or r.logprob_err_mean > t.max_logprob_err_mean
            or r.flip_margin_max > t.margin_noise)


def run_case(R, engine_model, ref, seeds, max_batch: int, threads: int) -> list[RolloutFigures]:
    torch.set_num_threads(threads)
    work = [(s, R.spec(s)) for s in seeds]
    comps = R.generate(R.engine_for(engine_model, max_batch=max_batch), work)
    torch.set_num_threads(2)
    return measure(R.claims_from(comps, work), ref)


FP8_TAMPERS = ("noise1pct", "int8", "plain_engine")


def fp8_cases(R, seeds: list[int]) -> dict[str, list[RolloutFigures]]:
    """Honest and tampered FP8 engines, per FP8 mode and base dtype, judged by an FP8 reference."""
    from node.engine.fp8.model import apply_fp8_mode

    cases: dict[str, list[RolloutFigures]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for mode in (m for m in FP8_MODES if m != "off"):
            base = R.tiny_model(dtype=dtype)
            ref = R.reference({0: apply_fp8_mode(copy.deepcopy(base), mode)})
            served = apply_fp8_mode(copy.deepcopy(base), mode)  # the engine's own copy, as a node loads it
            for max_batch in (1, 8, 32):
                for threads in (1, 2):
                    name = f"honest/{ref.precision}/batch{max_batch}/threads{threads}"
                    t = time.perf_counter()
                    cases[name] = run_case(R, served, ref, seeds, max_batch, threads)
                    log.info("%-48s %s (%.1fs)", name, summarize(cases[name]), time.perf_counter() - t)
            for kind in FP8_TAMPERS:
                engine_model = base if kind == "plain_engine" else apply_fp8_mode(perturb(base, kind), mode)
                name = f"tamper/{ref.precision}/{kind}"
                cases[name] = run_case(R, engine_model, ref, seeds, 32, 2)
                log.info("%-48s %s", name, summarize(cases[name]))
    return cases


def scored(cases: dict[str, list[RolloutFigures]], precisions) -> dict:
    out = {}
    for precision in precisions:
        honest = [r for k, rows in cases.items() if k.startswith(f"honest/{precision}/") for r in rows]
        t = THRESHOLDS[precision] if precision in THRESHOLDS else None
        out[precision] = {
            "honest_max": summarize(honest),
            "in_force": asdict(t) if t else None,
            "honest_rejected": sum(rejected_by(r, t) for r in honest) if t else None,
            "tamper_rejected_share": {k.split("/")[-1]: round(sum(rejected_by(r, t) for r in rows) / len(rows), 4)
                                      for k, rows in cases.items() if k.startswith(f"tamper/{precision}/")} if t else None,
        }
    return out


def merge(result: dict, records: dict) -> None:
    """Each precision's scored fields into `result`, keeping the fields other paths recorded there
    (`cross_device`, `bound_set_by`: the honest maxima of other devices the bounds also cover)."""
    for precision, rec in records.items():
        result["precisions"].setdefault(precision, {}).update(rec)


def main_fp8(args) -> int:
    data_path, thr_path = args.out / "data-fp8.json", args.out / "thresholds.json"
    if args.rescore:
        data = json.loads(data_path.read_text())
        cases = {k: [RolloutFigures(*row) for row in rows] for k, rows in data["cases"].items()}
    else:
        seeds = list(range(1000, 1000 + args.rollouts))
        cases = fp8_cases(_harness(), seeds)
        args.out.mkdir(parents=True, exist_ok=True)
        data_path.write_text(json.dumps({"fields": FIELDS,
                                         "cases": {k: [r.row() for r in rows] for k, rows in cases.items()}}) + "\n")
    precisions = sorted({k.split("/")[1] for k in cases})
    result = json.loads(thr_path.read_text())
    merge(result, scored(cases, precisions))
    rollouts = len(next(iter(cases.values())))
    result["fp8_command"] = f"python -m benchmarks.verification_calibration --fp8 --rollouts {rollouts}"
    thr_path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({p: result["precisions"][p] for p in precisions}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=64, help="rollouts per variation")
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--fp8", action="store_true", help="calibrate the FP8 precisions (merged into thresholds.json)")
    ap.add_argument("--rescore", action="store_true",
                    help="re-score data.json (with --fp8: data-fp8.json) at the thresholds in force, generate nothing")
    from benchmarks.calibration_device import add_arguments, main_device

    add_arguments(ap)
    args = ap.parse_args(argv)
    if args.device is not None:  # the device path: candidates to --results, thresholds.json untouched
        return main_device(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.fp8:
        return main_fp8(args)
    thr_path = args.out / "thresholds.json"
    result = json.loads(thr_path.read_text()) if thr_path.exists() else {"precisions": {}}
    if args.rescore:
        data = json.loads((args.out / "data.json").read_text())
        cases = {k: [RolloutFigures(*row) for row in rows] for k, rows in data["cases"].items()}
        merge(result, scored(cases, ("float32", "bfloat16")))
        thr_path.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({p: result["precisions"][p] for p in ("float32", "bfloat16")}))
        return 0
    R = _harness()
    models = {"float32": R.tiny_model(), "bfloat16": R.tiny_model(dtype=torch.bfloat16)}
    refs = {k: R.reference({0: m}) for k, m in models.items()}
    seeds = list(range(1000, 1000 + args.rollouts))
    cases: dict[str, list[RolloutFigures]] = {}
    for precision, model in models.items():
        for max_batch in (1, 8, 32):
            for threads in (1, 2):
                name = f"honest/{precision}/batch{max_batch}/threads{threads}"
                t = time.perf_counter()
                cases[name] = run_case(R, model, refs[precision], seeds, max_batch, threads)
                log.info("%-36s %s (%.1fs)", name, summarize(cases[name]), time.perf_counter() - t)
    for precision in models:
        for kind in ("noise1pct", "fp8", "int8"):
            name = f"tamper/{precision}/{kind}"
            cases[name] = run_case(R, perturb(models[precision], kind), refs[precision], seeds, 32, 2)
            log.info("%-36s %s", name, summarize(cases[name]))
    cases["tamper/float32/bf16_engine"] = run_case(R, models["bfloat16"], refs["float32"], seeds, 32, 2)
    log.info("%-36s %s", "tamper/float32/bf16_engine", summarize(cases["tamper/float32/bf16_engine"]))

    result.update(command=f"python -m benchmarks.verification_calibration --rollouts {args.rollouts}",
                  torch=torch.__version__)
    merge(result, scored(cases, models))
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"fields": FIELDS, "cases": {k: [r.row() for r in rows] for k, rows in cases.items()}}
    (args.out / "data.json").write_text(json.dumps(data) + "\n")
    thr_path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["precisions"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
