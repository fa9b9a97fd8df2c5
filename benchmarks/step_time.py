"""Where a trainer step's time goes in `primerl-node sim` (what `make run` runs), from the run's own records.

    python -m benchmarks.step_time [--steps 40] [--out DIR]     # run a sim (churn, 1 cheater), then attribute
    python -m benchmarks.step_time --from DIR                   # attribute a finished sim's directory

Sources, never assumed: the trainer's metrics.jsonl (per step: waiting for its batch, training,
publishing), each inference node's rounds.jsonl (per round: asking for leases, generating, submitting)
and versions.jsonl (per version: announce, fetch + verify, load), the validator's rounds.jsonl (judging),
the coordinator's store (when each unit was accepted, judged, batched or dropped as stale) and the sim's
events.json (process starts and SIGKILLs), and summary.json's CPU seconds of each role. Per step the figures are medians over steps; per inference
restart, the time from the process's start to its first accepted unit. The stages run concurrently
(inference generates while the trainer trains), so they are not a sum: `critical_path_s` says, for
each step, where its batch's last unit spent the time between the previous step's publication and
this step's batch: still generating, waiting for its verdict, or waiting for the trainer to ask.
Prints progress, then one JSON line; the last committed `make run` figure rides along (`committed`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import tempfile
from pathlib import Path

from node.sim_deadline import MEASURED

log = logging.getLogger(__name__)


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except OSError:
        return []


def _med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def _share(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


def trainer_stages(rows: list[dict]) -> dict:
    """Per step (medians): batch wait, training, publication and the whole step (asked -> published)."""
    train = [r["t_trained"] - r["t_asked"] - r["wait_s"] - r.get("publish_wait_s", 0.0) for r in rows]
    gaps = [b["t_asked"] - a["t_asked"] for a, b in zip(rows, rows[1:])]
    return {"steps": len(rows), "step_interval_s": _med(gaps), "batch_wait_s": _med([r["wait_s"] for r in rows]),
            "train_s": _med(train), "publish_s": _med([r["publish_s"] for r in rows]),
            "publish_wait_s": _med([r.get("publish_wait_s", 0.0) for r in rows]),
            "batch_wait_share": _share(sum(r["wait_s"] for r in rows), sum(gaps) + (gaps[-1] if gaps else 0))}


def inference_stages(out: Path) -> dict:
    """Per round of every inference node (medians): lease asked -> granted, generation, submission, and
    per version: announce -> queued for the engine (fetch + verify, load). An engine fed continuously (the
    role since session 6) writes activity rows instead of rounds: its generating share is its busy time."""
    lease, gen, submit, idle, fetch, load, announce = [], [], [], [], [], [], []
    busy = total = 0.0
    for node in sorted(out.glob("inference-*")):
        rounds = [r for r in _jsonl(node / "rounds.jsonl") if "t_lease" in r]
        for a, b in zip(rounds, rounds[1:]):
            if b["t_lease"] - a["t1"] < 60:  # the same process (a restart leaves a longer gap)
                idle.append(b["t_lease"] - (a["t_submitted"] or a["t1"]))
        for r in rounds:
            lease.append(r["t0"] - r["t_lease"])
            gen.append(r["t1"] - r["t0"])
            if r.get("t_submitted"):
                submit.append(r["t_submitted"] - r["t1"])
        if rounds:
            busy += sum(r["t1"] - r["t0"] for r in rounds)
            total += rounds[-1]["t1"] - rounds[0]["t_lease"]
        activity = [r for r in _jsonl(node / "rounds.jsonl") if "busy_s" in r]
        if activity:  # the engine thread's rows (continuous batching: no rounds, seconds inside engine steps)
            busy += sum(r["busy_s"] for r in activity)
            total += activity[-1]["t1"] - activity[0]["t0"]
        for v in _jsonl(node / "versions.jsonl"):
            fetch.append(v["t_fetched"] - v["t_fetch"])
            load.append(v["t_queued"] - v["t_fetched"])
            if v.get("t_announced"):
                announce.append(v["t_queued"] - v["t_announced"])
    return {"rounds": len(gen), "lease_s": _med(lease), "generate_s": _med(gen), "submit_s": _med(submit),
            "between_rounds_s": _med(idle), "generating_share": _share(busy, total),
            "version_fetch_s": _med(fetch), "version_load_s": _med(load), "announce_to_loaded_s": _med(announce)}


def validator_stages(out: Path) -> dict:
    rounds = _jsonl(out / "validator" / "rounds.jsonl")
    span = rounds[-1]["t1"] - rounds[0]["t0"] if rounds else 0.0
    return {"rounds": len(rounds), "judge_s": _med([r["t1"] - r["t0"] for r in rounds]),
            "units_per_round": _med([r["units"] for r in rounds]),
            "judging_share": _share(sum(r["t1"] - r["t0"] for r in rounds), span)}


def store_timeline(out: Path) -> tuple[list, dict[int, float], list[tuple[int, float]]]:
    """(accepted units, verdict times, (version, announced at)) from the coordinator's store."""
    from protocol.store import CoordinatorStore

    store = CoordinatorStore(out / "coordinator")
    try:
        return store.accepted(), store.verdict_times(), store.policy_versions(last=1_000_000)
    finally:
        store.close()


def critical_path(rows: list[dict], accepted: list, judged: dict[int, float]) -> dict:
    """For each step, the unit of its batch that was ready last: its acceptance and verdict against the
    time the trainer asked for the batch (`t_asked`) and got it (`t_asked + wait_s`)."""
    by_id = {a.work_id: a for a in accepted}
    generating, judging, waiting = [], [], []
    for prev, r in zip(rows, rows[1:]):
        units = [by_id[w] for w in r["work_ids"] if w in by_id]
        if not units:
            continue
        ready = max(units, key=lambda a: judged.get(a.work_id, a.accepted_at))
        start = prev["t"]  # the previous version's publication: the batch can only then be asked for
        accepted_at = max(start, ready.accepted_at)
        verdict_at = max(accepted_at, judged.get(ready.work_id, ready.accepted_at))
        got = r["t_asked"] + r["wait_s"]
        generating.append(max(0.0, min(accepted_at, got) - start))
        judging.append(max(0.0, min(verdict_at, got) - accepted_at))
        waiting.append(max(0.0, got - max(verdict_at, start)))
    return {"until_last_unit_accepted_s": _med(generating), "until_its_verdict_s": _med(judging),
            "after_ready_s": _med(waiting)}


def staleness(accepted: list, rows: list[dict]) -> dict:
    dropped = [a for a in accepted if a.dropped == "stale"]
    batched = [a for a in accepted if a.batch_step is not None]
    return {"units_accepted": len(accepted), "units_dropped_stale": len(dropped),
            "stale_share": _share(len(dropped), len(accepted)),
            "units_trained": sum(len(r["work_ids"]) for r in rows), "units_batched": len(batched)}


def restarts(out: Path, accepted: list) -> dict:
    """Per start of an inference process after its first: seconds until its first accepted unit."""
    events = json.loads((out / "events.json").read_text()) if (out / "events.json").exists() else {}
    from protocol.identity import NodeKey

    times = []
    for node in sorted(out.glob("inference-*")):
        peer = NodeKey.load(node / "node.key").peer_id
        mine = sorted(a.accepted_at for a in accepted if a.submitter == peer)
        starts = [t for t, what in events.get(node.name, []) if what == "start"][1:]
        for i, t in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else float("inf")
            first = next((x for x in mine if t <= x < end), None)
            if first is not None:
                times.append(first - t)
    return {"restarts_with_work": len(times), "first_accepted_after_start_s": _med(times),
            "first_accepted_after_start_max_s": round(max(times), 1) if times else None}


def cpu_per_step(summary: dict, steps: int) -> dict:
    """Each role's CPU seconds per trainer step (all its incarnations, start-ups and the trainer's warm-up
    included; `sim` reads them from /proc), and their sum: what a step costs the machine's cores."""
    cpu = summary.get("cpu_s") or {}
    if not cpu or not steps:
        return {}
    inference = sum(v for k, v in cpu.items() if k.startswith("inference-"))
    roles = {k: round(v / steps, 3) for k, v in cpu.items() if not k.startswith("inference-")}
    return {"total": round(sum(cpu.values()) / steps, 3), **roles, "inference_all": round(inference / steps, 3)}


def analyse(out: Path) -> dict:
    rows = _jsonl(out / "trainer" / "metrics.jsonl")
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    accepted, judged, _versions = store_timeline(out)
    return {
        "wall_s": summary.get("wall_s"), "status": summary.get("status"),
        "target_reached_step": summary.get("target_reached_step"),
        "target_reached_s": summary.get("target_reached_s"), "reward_last5": summary.get("reward_last5"),
        "trainer": trainer_stages(rows), "inference": inference_stages(out), "validator": validator_stages(out),
        "critical_path_s": critical_path(rows, accepted, judged), "stale": staleness(accepted, rows),
        "inference_restarts": restarts(out, accepted),
        "cpu_s_per_step": cpu_per_step(summary, len(rows)),
        "reward_after_warmup": rows[0]["reward_mean"] if rows else None,
        "honest_banned": summary.get("honest_banned"), "cheaters_banned": summary.get("cheaters_banned"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", type=Path, help="attribute this finished sim directory (no new run)")
    p.add_argument("--steps", type=int, default=40, help="trainer steps of the sim to run")
    p.add_argument("--stop-after-target", type=int, default=-1, help="as `sim` (-1: train all --steps)")
    p.add_argument("--out", type=Path, help="the sim's directory (default: a temporary one)")
    p.add_argument("--json", type=Path, help="write the JSON result here too")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    load_before = os.getloadavg()[0]
    if args.source is None:
        from node.sim import run_sim

        out = args.out or Path(tempfile.mkdtemp(prefix="step_time-"))
        log.info("sim: 4 inference nodes, churn, 1 cheater, reverse, %d steps -> %s", args.steps, out)
        run_sim(out, inference_nodes=4, steps=args.steps, task="reverse", churn=True, cheaters=1,
                stop_after_target=None if args.stop_after_target < 0 else args.stop_after_target)
    else:
        out = args.source
    result = {"benchmark": "step_time", "machine": f"{platform.machine()}-{os.cpu_count()}cpu", "dir": str(out),
              "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2), **analyse(out),
              "committed": {"target_reached_step": MEASURED["target_step"], "target_reached_s": MEASURED["target_s"],
                            "machine": MEASURED["machine"]}}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
