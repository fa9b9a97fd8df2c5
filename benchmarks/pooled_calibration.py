"""Bounds of the pooled check (`verification.pooled.POOLED`) from claims' evidence, and what they catch.

    python -m benchmarks.pooled_calibration EVIDENCE.jsonl [...] [--out verification/calibration/pooled.json]

Input: JSON lines as `benchmarks.detection_device --evidence` writes them (one per claim: its tags
`precision`, `case`, `shape`, `engine_device`, `judge_device`, its `work_id`, and the `Evidence` sums).
A path is (shape, engine device, judge device, engine batch); the honest claims (`case` "honest") of each path and
precision give, per statistic, the path's mean per chunk (token) and its per-chunk (per-token)
standard deviation, estimated from the claims' own means (var = mean over claims of n x (claim mean -
path mean)^2, so chunks of one rollout may correlate). Per precision: centre = HARDWARE_MARGIN x the
largest path mean, width = Z x the largest standard deviation, and a centre raised where an honest submission would
still fail (`cover`: statistics far from normal). Then every case's submissions (claims
sharing a work id) are judged by those bounds: honest ones must pass, the share of each tamper caught
is reported. Prints one JSON line; `--out` also writes it (the record `POOLED` cites).

Per served shape (`by_shape`, the record `POOLED_BY_SHAPE` cites): the same rule over one shape's honest claims
alone (a shape the benchmarks' `SHAPES` name, keyed by `verification.pooled.shape_of`), what those bounds catch
at that shape, and a held-out check: bounds from the submissions of even work ids judging those of odd ones.
A submission is the claims sharing (input file, precision, path, case, work id): two files' work ids may repeat.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

from verification.pooled import (HARDWARE_MARGIN, MIN_CHUNKS, MIN_TOKENS, POOLED, POOLED_BY_SHAPE, Z, Evidence,
                                PooledBound, PooledThresholds, check_pooled, nearest_bound, ratio, shape_of)

STATS = (("exp_per_chunk", "exp_mismatches", "chunks"), ("mant_err_mean", "mant_err", "chunks"),
         ("logprob_err_mean", "logprob_err", "tokens"))


def read(paths: list[Path]) -> list[dict]:
    """Evidence rows of JSON-lines files (gzip-compressed when named .gz), each tagged with its file's name."""
    rows = []
    for p in paths:
        text = gzip.decompress(p.read_bytes()).decode() if p.suffix == ".gz" else p.read_text()
        rows += [{**json.loads(x), "source": p.name} for x in text.splitlines() if x.strip()]
    return rows


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


def calibrate(rows: list[dict], honest_cases: tuple[str, ...] = ("honest",)) -> dict:
    honest: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["case"] in honest_cases:
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
        cover(bounds, submissions([r for rs in paths.values() for r in rs])[0])
        out[precision] = {"bounds": bounds, "paths": {p: {k: [round(x, 5) for x in v] for k, v in m.items()}
                                                      for p, m in per_path.items()},
                          "honest_claims": {p: len(rs) for p, rs in paths.items()}}
    return out


def cover(bounds: dict, honest: dict[tuple, Evidence]) -> None:
    """Raise a centre, in place, to the least that passes every honest submission judged pooled: `width / sqrt(n)`
    stands for a pooled mean's spread only where the statistic is near normal, and one that is mostly exact zeros
    (a float32 CPU path, its engine and judge agreeing bit for bit on nearly every chunk) has submissions far out
    in its tail. The bounds of the GPU evidence are never raised by it (their worst honest submission sits at
    0.87 of its bound or less); "centre_set_by" then names the submission."""
    for unit, ev in honest.items():
        n_of = {"exp_per_chunk": ev.chunks, "mant_err_mean": ev.chunks, "logprob_err_mean": ev.tokens}
        for name, mean in ev.means().items():
            n, b = n_of[name], bounds[name]
            if ev.chunks < MIN_CHUNKS or (name == "logprob_err_mean" and n < MIN_TOKENS):
                continue  # not judged pooled (`nearest_bound`)
            need = math.ceil((mean - b["width"] / math.sqrt(n)) * 1e5) / 1e5
            if need > b["centre"]:
                b["centre"], b["centre_set_by"] = need, f"the honest submission {unit[1]} work {unit[4]}"


def submissions(rows: list[dict]) -> tuple[dict[tuple, Evidence], set[tuple]]:
    """The claims' submissions (input file, precision, path, case, work id, shape) and their pooled evidence (of the
    claims that passed alone), and those with a claim that failed alone."""
    units: dict[tuple, Evidence] = {}
    failed_alone: set[tuple] = set()
    for r in rows:
        unit = (r["precision"], path_of(r), r["case"], r.get("source"), r["work_id"], r["shape"])
        units.setdefault(unit, Evidence())  # a unit whose claims all failed alone still counts
        if not r.get("passed_alone", True):
            failed_alone.add(unit)
            continue
        units[unit].add(Evidence(**{k: r[k] for k in ("chunks", "exp_mismatches", "mant_err", "tokens", "logprob_err")},
                                 positions=r.get("positions", 0)))
    return units, failed_alone


def in_force() -> dict:
    """`verification.pooled.POOLED` in `calibrate`'s form (to judge evidence by the bounds in force)."""
    from dataclasses import asdict

    return {p: {"bounds": asdict(t)} for p, t in POOLED.items()}


def thresholds(bounds: dict) -> PooledThresholds:
    stats = {k: PooledBound(v["centre"], v["width"]) for k, v in bounds.items() if isinstance(v, dict)}
    return PooledThresholds(**stats, max_positions=bounds.get("max_positions"))


def in_force_by_shape(names) -> dict:
    """`verification.pooled.POOLED_BY_SHAPE` for those of the named shapes that have their own bounds, in
    `calibrate`'s form per name."""
    from dataclasses import asdict

    own = {name: POOLED_BY_SHAPE.get(shape_key(name) or "") for name in names}
    return {name: {p: {"bounds": asdict(t)} for p, t in b.items()} for name, b in own.items() if b}


def caught(rows: list[dict], cal: dict, by_shape: dict | None = None) -> dict:
    """Per precision, path and case: submissions, the share rejected (a claim failed alone, `passed_alone` false,
    or the pooled bounds `cal` reject the rest together, as the validator forms a unit's verdict), and `nearest`:
    the largest pooled figure over its bound among the submissions judged pooled (honest ones' margin).
    `by_shape`: per shape name, bounds that replace `cal`'s for its rows (`in_force_by_shape`)."""
    units, failed_alone = submissions(rows)
    tally: dict = defaultdict(lambda: [0, 0, 0.0])
    for unit, ev in units.items():
        precision, path, case, _, _, shape = unit
        own = (by_shape or {}).get(shape, {}).get(precision)
        own = thresholds(own["bounds"]) if own is not None else None
        if own is not None and own.hold_for(ev.positions):  # a shape's own, up to the length it measured
            t = {precision: own}
        elif precision in cal:
            t = {precision: thresholds(cal[precision]["bounds"])}
        else:
            continue
        over = unit in failed_alone or check_pooled(ev, precision, 1, t) is not None
        near = nearest_bound(ev, t[precision])
        cell = tally[(precision, path, case)]
        cell[0] += 1
        cell[1] += bool(over)
        cell[2] = max(cell[2], ratio(near[1], near[2]) if near and unit not in failed_alone else 0.0)
    out: dict = defaultdict(dict)
    for (precision, path, case), (n, k, near) in sorted(tally.items()):
        out[f"{precision} {path}"][case] = {"submissions": n, "rejected": round(k / n, 4), "nearest": round(near, 3)}
    return dict(out)


def shape_key(name: str) -> str | None:
    """`shape_of` of a shape the benchmarks name (benchmarks/device_rollouts.py, random_checkpoint.py), or None;
    a validator role's rows name the key itself (node/roles/validator.py `evidence_rows`)."""
    from benchmarks import device_rollouts, random_checkpoint
    from node.model import ModelConfig

    if ":layers=" in name:
        return name
    if name in device_rollouts.SHAPES:
        return shape_of(device_rollouts.config_of(name))
    if name in random_checkpoint.SHAPES:
        return shape_of(ModelConfig(**random_checkpoint.SHAPES[name]))
    return None


def by_shape(rows: list[dict], honest_cases: tuple[str, ...] = ("honest",)) -> dict:
    """Per served shape with honest claims: bounds from its rows alone (`calibrate`), what they catch there, and
    bounds from its even work ids judging its odd ones (`held_out`). Rows naming one shape two ways (a benchmark's
    name, a role's key) are one shape, reported under the first name."""
    names: dict[str, str] = {}
    for name in sorted({r["shape"] for r in rows if r["case"] in honest_cases}):
        key = shape_key(name)
        if key is not None:
            names.setdefault(key, name)
    out = {}
    for key, name in names.items():
        mine = [r for r in rows if shape_key(r["shape"]) == key]
        cal = calibrate(mine, honest_cases)
        half = calibrate([r for r in mine if r["work_id"] % 2 == 0], honest_cases)
        told = [(r["precision"], r["positions"]) for r in mine if r["case"] in honest_cases and r.get("positions")]
        longest = {p: max(n for q, n in told if q == p) for p in sorted({p for p, _ in told})}
        out[name] = {"key": key, "positions_max": max(longest.values()) if longest else None,
                     "positions_max_by_precision": longest,
                     "calibration": cal, "pooled_rejections": caught(mine, cal),
                     "held_out": caught([r for r in mine if r["work_id"] % 2 == 1], half)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("evidence", type=Path, nargs="*")
    ap.add_argument("--fixture", type=Path, action="append", default=[],
                    help="also a cross-device fixture's claims judged here on the CPU (tests/fixtures/cross_device)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--honest", action="append", default=["honest"],
                    help="also count claims of this case as honest (`network`: a traced validator's, of honest nodes)")
    args = ap.parse_args(argv)
    rows = read(args.evidence) + [r for d in args.fixture for r in fixture_evidence(d)]
    honest = tuple(args.honest)
    cal = calibrate(rows, honest)
    result = {"bench": "pooled_calibration", "inputs": [str(p) for p in args.evidence + args.fixture],
              "claims": len(rows),
              "hardware_margin": HARDWARE_MARGIN, "z": Z, "min_chunks": MIN_CHUNKS, "min_tokens": MIN_TOKENS,
              "calibration": cal, "pooled_rejections": caught(rows, cal),
              "pooled_rejections_in_force": caught(rows, in_force(), in_force_by_shape({r["shape"] for r in rows})),
              "honest_cases": list(honest), "by_shape": by_shape(rows, honest)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
