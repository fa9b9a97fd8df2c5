"""Asynchronous vs synchronous RL on the whole network (`primerl-node sim` processes), with
heavy-tailed rollout durations.

    python -m benchmarks.async_speedup [--steps 40] [--ks 0,1,2,4] [--tool-wait 0.5] [--target 0.3]

Every run: same seed, same task, same number of trainer steps and batch shape; each episode's
tool calls wait a Pareto(1.5) time with median `--tool-wait` s (the same wait for the same work
unit in every run; see `node.roles.inference.tool_wait`): the waits of sandboxed tools, during
which the engine keeps decoding other episodes. k = 0 (`max_off_policy_steps`) is synchronous:
the trainer can only train on the newest version's rollouts, so every step waits for the
slowest episode of the batch and inference idles while the trainer steps. k >= 1 lets the next
batch's rollouts (and their tool waits) overlap the current step.

Figures per k: training tokens/s (completion tokens trained on / RL wall time), time to the
reward target (3-step moving average), final reward (last 5 steps); ratios against k = 0
measured in the same run. Prints progress, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import tempfile
from pathlib import Path

from node.sim import run_sim


def figures(rows: list[dict], target: float) -> dict:
    start = rows[0]["t"] - rows[0]["step_s"]
    wall = rows[-1]["t"] - start
    tokens = sum(r["tokens"] for r in rows)
    rewards = [r["reward_mean"] for r in rows]
    reach = None
    for i in range(2, len(rows)):
        if sum(rewards[i - 2 : i + 1]) / 3 >= target:
            reach = rows[i]["t"] - start
            break
    return {"rl_wall_s": round(wall, 1), "train_tokens_per_s": round(tokens / wall, 1),
            "time_to_target_s": None if reach is None else round(reach, 1),
            "reward_last5": round(sum(rewards[-5:]) / len(rewards[-5:]), 4),
            "mean_lag": round(sum(sum(r["lags"]) for r in rows) / sum(len(r["lags"]) for r in rows), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ks", default="0,1,2,4")
    p.add_argument("--inference-nodes", type=int, default=2)
    p.add_argument("--batch-groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--tool-wait", type=float, default=0.5, help="median tool wait per episode (s)")
    p.add_argument("--target", type=float, default=0.3, help="reward target (3-step moving average)")
    p.add_argument("--out", type=Path, help="write the JSON result here too")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    ks = [int(k) for k in args.ks.split(",")]
    results: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in ks:
            print(f"k={k}: sim with {args.inference_nodes} inference nodes, {args.steps} steps ...", flush=True)
            s = run_sim(Path(tmp) / f"k{k}", inference_nodes=args.inference_nodes, steps=args.steps,
                        batch_groups=args.batch_groups, group_size=args.group_size, max_off_policy_steps=k,
                        seed=0, timeout_s=900, recipe={"tool_wait_s": args.tool_wait})
            rows = [json.loads(x) for x in (Path(tmp) / f"k{k}" / "trainer" / "metrics.jsonl").read_text().splitlines()]
            results[k] = {**figures(rows, args.target), "status": s["status"], "steps": s["steps"],
                          "max_off_policy_seen": s["max_off_policy_seen"], "rollouts_lost": s["rollouts_lost"]}
            print(f"k={k}: {results[k]}", flush=True)
    base = results.get(0)
    out = {"benchmark": "async_speedup", "machine": f"{platform.machine()}, {_cores()} cores",
           "settings": vars(args) | {"out": None}, "by_k": results}
    if base:
        out["tokens_per_s_ratio_vs_sync"] = {k: round(r["train_tokens_per_s"] / base["train_tokens_per_s"], 2)
                                             for k, r in results.items()}
        out["time_to_target_ratio_sync_over_async"] = {
            k: (round(base["time_to_target_s"] / r["time_to_target_s"], 2)
                if base["time_to_target_s"] and r["time_to_target_s"] else None) for k, r in results.items()}
    line = json.dumps(out)
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(line)


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
