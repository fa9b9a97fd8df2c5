"""Weight latency: from the end of a trainer step until every inference node has the new version
loaded for its next decode step, for N = 1, 4, 8, 16 inference nodes (`primerl-node sim` processes).

    python -m benchmarks.weight_latency [--ns 1,4,8,16] [--steps 8]

Path measured per version v: trainer step ends (`t_trained`) -> shardcast publish (delta) ->
coordinator announces over gossip -> each node fetches from origin + relay, verifies the
signature and every shard hash -> queues the weights in its engine (`versions.jsonl`,
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


def latencies(out: Path, n: int) -> list[float]:
    rows = [json.loads(x) for x in (out / "trainer" / "metrics.jsonl").read_text().splitlines()]
    trained = {r["step"]: r["t_trained"] for r in rows}
    loaded: list[list[tuple[int, float]]] = []
    for i in range(n):
        path = out / f"inference-{i}" / "versions.jsonl"
        loaded.append([(d["version"], d["t_queued"]) for d in map(json.loads, path.read_text().splitlines())])
    result = []
    for v, t in sorted(trained.items()):
        per_node = [min((tq for ver, tq in node if ver >= v), default=None) for node in loaded]
        if all(x is not None for x in per_node):
            result.append(max(per_node) - t)
    return result


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
            lat = latencies(out, n)
            results[n] = {"versions": len(lat), "median_s": round(statistics.median(lat), 3) if lat else None,
                          "max_s": round(max(lat), 3) if lat else None, "status": s["status"]}
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
