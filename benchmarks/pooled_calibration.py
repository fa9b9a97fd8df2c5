"""Bounds of the pooled check (`verification.pooled.POOLED`) from claims' evidence, and what they catch.

    python -m benchmarks.pooled_calibration EVIDENCE.jsonl [...] [--out verification/calibration/pooled.json]

Input: JSON lines as `benchmarks.detection_device --evidence` writes them (one per claim: its tags
`precision`, `case`, `shape`, `engine_device`, `judge_device`, its `work_id`, and the `Evidence` sums).
A path is (shape, engine device, judge device, engine batch); the honest claims (`case` "honest") of each path and
precision give, per statistic, the path's mean per chunk (token) and its per-chunk (per-token)
standard deviation, estimated from the claims' own means (var = mean over claims of n x (claim mean -
path mean)^2, so chunks of one rollout may correlate). Per precision: centre = HARDWARE_MARGIN x the
largest path mean, width = Z x the largest standard deviation. Then every case's submissions (claims
sharing a work id) are judged by those bounds: honest ones must pass, the share of each tamper caught
is reported. Prints one JSON line; `--out` also writes it (the record `POOLED` cites).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

from verification.pooled import (HARDWARE_MARGIN, MIN_CHUNKS, MIN_TOKENS, POOLED, Z, Evidence, PooledBound,
                                PooledThresholds, check_pooled)

STATS = (("exp_per_chunk", "exp_mismatches", "chunks"), ("mant_err_mean", "mant_err", "chunks"),
         ("logprob_err_mean", "logprob_err", "tokens"))


def read(paths: list[Path]) -> list[dict]:
    """Evidence rows of JSON-lines files (gzip-compressed when named .gz)."""
    text = (gzip.decompress(p.read_bytes()).decode() if p.suffix == ".gz" else p.read_text() for p in paths)
    return [json.loads(x) for t in text for x in t.splitlines() if x.strip()]


def fixture_evidence(directory: Path) -> list[dict]:
    """Evidence rows of a cross-device fixture's claims (benchmarks/cross_device_files: generated on
    another device, judged here on the CPU as the validator role judges them), all honest."""
    from benchmarks.cross_device_files import read_fixture, reference
    from verification.validator import verify_claims

    fx = read_fixture(directory)
    evidence: list = []
    verify_claims(fx.claims, reference(fx, "cpu"), None, fx.spec.engines, evidence=evidence)
    src = fx.provenance.get("device_name", fx.provenance.get("device", "?")).replace(" ", "-")
    return [{"precision": fx.spec.model.dtype if fx.spec.model.fp8 == "off" else f"fp8-{fx.spec.model.fp8}-"
             f"{fx.spec.model.dtype}", "case": "honest", "shape": f"fixture-{directory.name}", "engine_device": src,
             "judge_device": "cpu", "batch": case.split("/")[1] if "/" in case else "?", "work_id": c.work_id,
             "tokens_claimed": len(c.token_ids), **vars(e)} for c, e, case in zip(fx.claims, evidence, fx.cases)]


def path_of(row: dict) -> str:
    return f"{row['shape']}:{row['engine_device']}->{row['judge_device']}:b{row.get('batch', '?')}"


def moments(rows: list[dict], total: str, count: str) -> tuple[float, float]:
    """(mean per unit, per-unit standard deviation) of `total`/`count` over claims, weighted by count."""
    n = sum(r[count] for r in rows)
    if n == 0:
        return 0.0, 0.0
    mean = sum(r[total] for r in rows) / n
    var = sum(r[count] * (r[total] / r[count] - mean) ** 2 for r in rows if r[count]) / max(1, len(rows))
    return mean, math.sqrt(var)


def calibrate(rows: list[dict]) -> dict:
    honest: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["case"] == "honest":
            honest[r["precision"]][path_of(r)].append(r)
    out = {}
    for precision, paths in honest.items():
        per_path = {p: {name: moments(rs, total, count) for name, total, count in STATS} for p, rs in paths.items()}
        bounds = {}
        for name, _, _ in STATS:
            worst_mean = max(per_path, key=lambda p: per_path[p][name][0])
            worst_sd = max(per_path, key=lambda p: per_path[p][name][1])
            bounds[name] = {"centre": round(HARDWARE_MARGIN * per_path[worst_mean][name][0], 5),
                            "width": round(Z * per_path[worst_sd][name][1], 5),
                            "centre_set_by": worst_mean, "width_set_by": worst_sd}
        out[precision] = {"bounds": bounds, "paths": {p: {k: [round(x, 5) for x in v] for k, v in m.items()}
                                                      for p, m in per_path.items()},
                          "honest_claims": {p: len(rs) for p, rs in paths.items()}}
    return out


def in_force() -> dict:
    """`verification.pooled.POOLED` in `calibrate`'s form (to judge evidence by the bounds in force)."""
    from dataclasses import asdict

    return {p: {"bounds": asdict(t)} for p, t in POOLED.items()}


def thresholds(bounds: dict) -> PooledThresholds:
    return PooledThresholds(**{k: PooledBound(v["centre"], v["width"]) for k, v in bounds.items()})


def caught(rows: list[dict], cal: dict) -> dict:
    """Per precision, path and case: submissions, and the share rejected: a claim failed alone (`passed_alone`
    false), or the pooled bounds `cal` reject the rest together (as the validator forms a unit's verdict)."""
    units: dict[tuple, Evidence] = {}
    failed_alone: set[tuple] = set()
    for r in rows:
        unit = (r["precision"], path_of(r), r["case"], r["work_id"])
        units.setdefault(unit, Evidence())  # a unit whose claims all failed alone still counts
        if not r.get("passed_alone", True):
            failed_alone.add(unit)
            continue
        units[unit].add(Evidence(**{k: r[k] for k in ("chunks", "exp_mismatches", "mant_err", "tokens", "logprob_err")}))
    tally: dict = defaultdict(lambda: [0, 0])
    for unit, ev in units.items():
        precision, path, case, _ = unit
        if precision not in cal:
            continue
        t = {precision: thresholds(cal[precision]["bounds"])}
        over = unit in failed_alone or check_pooled(ev, precision, 1, t) is not None
        cell = tally[(precision, path, case)]
        cell[0] += 1
        cell[1] += bool(over)
    out: dict = defaultdict(dict)
    for (precision, path, case), (n, k) in sorted(tally.items()):
        out[f"{precision} {path}"][case] = {"submissions": n, "rejected": round(k / n, 4)}
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("evidence", type=Path, nargs="*")
    ap.add_argument("--fixture", type=Path, action="append", default=[],
                    help="also a cross-device fixture's claims judged here on the CPU (tests/fixtures/cross_device)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = read(args.evidence) + [r for d in args.fixture for r in fixture_evidence(d)]
    cal = calibrate(rows)
    result = {"bench": "pooled_calibration", "inputs": [str(p) for p in args.evidence + args.fixture],
              "claims": len(rows),
              "hardware_margin": HARDWARE_MARGIN, "z": Z, "min_chunks": MIN_CHUNKS, "min_tokens": MIN_TOKENS,
              "calibration": cal, "pooled_rejections": caught(rows, cal),
              "pooled_rejections_in_force": caught(rows, in_force())}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
