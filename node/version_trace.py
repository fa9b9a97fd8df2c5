"""A node's record of its work over time, for benchmarks: WORKDIR/versions.jsonl, one line per policy
version an inference node queued for its engine (`version`, `t_announced`, `t_fetch`, `t_fetched`,
`t_queued`, Unix seconds; `fetch_stages_s`: the fetch's download, verify, decode and write seconds) or a validator
held (`t_held`, `fetch_s`, `hold_s`, `behind_s`, `prepare_s`, `changed_bytes`: node/roles/validator.py `on_held`), and
WORKDIR/rounds.jsonl, one line per rollout round of an inference node
(`t0`, `t1`, `groups`, `tokens`, `versions`) or judging round of a validator (`t0`, `t1`, `units`, `tokens`, `verify_s`,
`turn_wait_s`, and since session 25 `versions`, `mixed`, `alone`, `gc_s`, `gc_full`: node/roles/validator.py `on_round`).

Installed by `join --trace-versions` on an inference node or a validator (`sim` passes it; benchmarks
weight_latency and gpu_network read the files); the roles themselves only call their hooks.
"""

from __future__ import annotations

import json
from pathlib import Path

FILE = "versions.jsonl"
ROUNDS = "rounds.jsonl"
EVIDENCE = "evidence.jsonl"
"""A validator's: each judged claim's pooled-check evidence (node/roles/validator.py `evidence_rows`)."""
SWAPS = "swaps.jsonl"
"""One line per version a built-in engine put into its weights (`version`, `t_applied`, `stage_s`: staged
on the device off the engine's thread, `apply_s`: the swap between two steps, `staged_on_device`, `bytes`, and since
session 32 `t_lease_asked`, `t_granted`: when the node first asked for, and first got, leases holding it; since
session 33 `ring_host_s`, `ring_wait_s`, `ring_threads`: the staging's pinned-ring seconds, `SwapTimes`)."""


def judging_summary(rows: list[dict]) -> dict:
    """A validator's rounds (rows of ROUNDS) in three figures: seconds recomputing, the round that recomputed
    longest as its row says what it was (its times dropped), and the collector's seconds inside rounds (None where
    the rows predate session 25's `gc_s`)."""
    slowest = max(rows, key=lambda r: r.get("verify_s", 0.0), default=None)
    timed = [r["gc_s"] for r in rows if "gc_s" in r]
    return {"validator_verify_s": round(sum(r.get("verify_s", 0.0) for r in rows), 2),
            "validator_slowest_round": None if slowest is None else {k: v for k, v in slowest.items()
                                                                     if k not in ("t0", "t1")},
            "validator_gc_s": round(sum(timed), 2) if timed else None}


class VersionTrace:
    """An `InferenceNode.on_loaded` hook appending one JSON line per version queued for the engine."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, version: int, times: dict[str, float | None]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"version": version, **times}) + "\n")


class RoundTrace:
    """An `on_round` hook appending each round's row (an `on_evidence` hook: each of its rows) to a JSON-lines
    file."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, row: dict | list[dict]) -> None:
        with self.path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in (row if isinstance(row, list) else [row]))


def install(node) -> None:
    """Trace `node` (an InferenceNode or a ValidatorNode) into its workdir."""
    if hasattr(node, "on_loaded"):
        node.on_loaded.append(VersionTrace(node.workdir / FILE))
    if hasattr(node, "on_held"):  # a validator's holds
        node.on_held.append(VersionTrace(node.workdir / FILE))
    if hasattr(node, "on_swapped"):
        node.on_swapped.append(VersionTrace(node.workdir / SWAPS))
    node.on_round.append(RoundTrace(node.workdir / ROUNDS))
    if hasattr(node, "on_evidence"):
        node.on_evidence.append(RoundTrace(node.workdir / EVIDENCE))
