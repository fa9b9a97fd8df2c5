"""Re-derive the verification thresholds: `python -m verification.calibration.calibrate`.

Generates honest rollouts of the tiny test model under every variation an honest node may run
(batch size 1..32 with continuous batching, 1 or 2 threads, and, per engine precision, the
KV-cached decode against the validator's prefill in that precision), measures them, does the same
for tampered engines (1% weight noise, fp8 and int8 weight rounding, a bf16 engine claiming
float32), and writes `data.json` (one row per rollout) and `thresholds.json` (honest maxima per
precision, the thresholds in force, and the share of tampered rollouts they reject) next to this
file. tests/verification/test_calibration.py holds the thresholds in force above the honest maxima.
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

from verification.calibration.measure import FIELDS, RolloutFigures, measure, summarize
from verification.checks import THRESHOLDS, Thresholds

HERE = Path(__file__).parent
log = logging.getLogger("calibrate")


def _harness():
    sys.path.insert(0, str(HERE.parents[1] / "tests" / "verification"))
    import rollouts  # the shared test harness: tiny model, engine, claims

    return rollouts


def perturb(model: torch.nn.Module, kind: str, seed: int = 1) -> torch.nn.Module:
    """A tampered copy: 'noise1pct' (weights x (1 + 0.01 N(0,1))), 'fp8' (e4m3 round trip with a
    per-row scale), 'int8' (symmetric per-row round trip). Norm weights are left alone."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                continue
            w = p.float()
            if kind == "noise1pct":
                q = w * (1 + 0.01 * torch.randn(p.shape, generator=g))
            else:
                scale = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
                if kind == "fp8":
                    q = (w / scale * 448.0).to(torch.float8_e4m3fn).float() / 448.0 * scale
                elif kind == "int8":
                    q = (w / scale * 127.0).round() / 127.0 * scale
                else:
                    raise ValueError(kind)
            p.copy_(q.to(p.dtype))
    return m


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=64, help="rollouts per variation")
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
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

    result = {"command": f"python -m verification.calibration.calibrate --rollouts {args.rollouts}",
              "torch": torch.__version__, "precisions": {}}
    for precision in models:
        honest = [r for k, rows in cases.items() if k.startswith(f"honest/{precision}/") for r in rows]
        t = THRESHOLDS[precision]
        result["precisions"][precision] = {
            "honest_max": summarize(honest),
            "in_force": asdict(t),
            "honest_rejected": sum(rejected_by(r, t) for r in honest),
            "tamper_rejected_share": {k.split("/")[-1]: round(sum(rejected_by(r, t) for r in rows) / len(rows), 4)
                                      for k, rows in cases.items() if k.startswith(f"tamper/{precision}/")},
        }
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"fields": FIELDS, "cases": {k: [r.row() for r in rows] for k, rows in cases.items()}}
    (args.out / "data.json").write_text(json.dumps(data) + "\n")
    (args.out / "thresholds.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["precisions"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
