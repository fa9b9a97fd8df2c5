"""Weight latency: from the end of a trainer step until every inference node has the new version
loaded for its next decode step, for N = 1, 4, 8, 16 inference nodes (`primerl-node sim` processes),
with the slowest node's time split into stages (announce over gossip, queued behind an earlier
fetch, fetch + verify, load).

    python -m benchmarks.weight_latency [--ns 1,4,8,16] [--steps 8]

Path measured per version v: trainer step ends (`t_trained`) -> shardcast publish (delta) ->
coordinator announces over gossip -> each node fetches from origin + relay, verifies the
signature and every shard hash -> queues the weights in its engine (`versions.jsonl`, written by `join --trace-versions`,
`t_queued`; the engine applies them before its next decode step, a few ms later). A node that
skips v because v+1 arrived first counts at its first version >= v. Latency of v = the slowest
node. Peer: N = 1 in the same run; the aim is N = 16 within 2x of N = 1. Every process shares
this machine's cores, so on 2 cores the figure includes CPU contention between 20 processes.
Prints progress, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import tempfile
from pathlib import Path

from node.sim import run_sim


def latencies(out: Path, n: int) -> tuple[list[float], dict[str, list[float]]]:
    """Per version: the slowest node's latency, and where that node's time went (stages)."""
    rows = [json.loads(x) for x in (out / "trainer" / "metrics.jsonl").read_text().splitlines()]
    trained = {r["step"]: r["t_trained"] for r in rows}
    loaded: list[list[dict]] = []
    for i in range(n):
        path = out / f"inference-{i}" / "versions.jsonl"
        loaded.append([json.loads(x) for x in path.read_text().splitlines()])
    result: list[float] = []
    stages: dict[str, list[float]] = {"announce_s": [], "queued_behind_fetch_s": [], "fetch_verify_s": [], "load_s": []}
    for v, t in sorted(trained.items()):
        per_node = [min((d for d in node if d["version"] >= v), key=lambda d: d["t_queued"], default=None)
                    for node in loaded]
        if any(d is None for d in per_node):
            continue
        slowest = max(per_node, key=lambda d: d["t_queued"])
        result.append(slowest["t_queued"] - t)
        if slowest.get("t_announced") and slowest["version"] == v:
            stages["announce_s"].append(slowest["t_announced"] - t)
            stages["queued_behind_fetch_s"].append(max(0.0, slowest["t_fetch"] - slowest["t_announced"]))
            stages["fetch_verify_s"].append(slowest["t_fetched"] - slowest["t_fetch"])
            stages["load_s"].append(slowest["t_queued"] - slowest["t_fetched"])
    return result, stages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", default="1,4,8,16")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", type=Path, help="write the JSON result here too")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in args.ns.split(",")]:
            print(f"N={n}: sim with {n} inference nodes, {args.steps} steps ...", flush=True)
            out = Path(tmp) / f"n{n}"
            s = run_sim(out, inference_nodes=n, steps=args.steps, batch_groups=max(4, n), group_size=4,
                        max_off_policy_steps=1, seed=0, timeout_s=600)
            lat, stages = latencies(out, n)
            results[n] = {"versions": len(lat), "median_s": round(statistics.median(lat), 3) if lat else None,
                          "max_s": round(max(lat), 3) if lat else None, "status": s["status"],
                          "slowest_node_median_stages_s": {k: round(statistics.median(v), 3)
                                                           for k, v in stages.items() if v}}
            print(f"N={n}: {results[n]}", flush=True)
    ns = sorted(results)
    out = {"benchmark": "weight_latency", "machine": f"{platform.machine()}", "steps": args.steps, "by_n": results}
    if results[ns[0]]["median_s"]:
        out["median_ratio_vs_n1"] = {n: round(r["median_s"] / results[ns[0]]["median_s"], 2)
                                     for n, r in results.items() if r["median_s"]}
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
