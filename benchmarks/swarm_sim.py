"""`python -m benchmarks.swarm_sim`: weight latency for 1,000 inference nodes on home links, simulated.

A trainer's origin (1 Gbit/s up by default), 0, 4 or 16 datacenter relays and N residential
inference nodes (down lognormal 50-1000 Mbit/s, up 10-100, RTT 20-200 ms; each lists the origin and `--peers` random other nodes as sources; with relays, nodes list the relays
instead of the origin, whose uplink then serves the relays alone) fetch one new version at once; `--churn`
of the nodes leave at a random moment during the fetch. Every source/shard choice, failure
reaction and relay decision is shardcast's own code (`benchmarks/swarm_model.py` says what is
modelled instead). Cases: 1 GB and 60 GB versions, full and delta (the delta's size from the
measured full/sparse ratio of real RL updates, `shardcast_delta-real-*.json`), 0/4/16 relays.
Latency = announce -> every shard verified, per node that stayed. The peer: the same node alone
(N = 1, the same links drawn `--n1-trials` times), so `p99_ratio_n1000_vs_n1` says what the swarm
costs a node. `--validate` instead prints the model's prediction for `benchmarks.shardcast`'s
loopback scenarios (see docs/shardcast.md). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import time
from pathlib import Path

from benchmarks.swarm_model import Host, Swarm
from shardcast.seeding import SeedOffer

REPO = Path(__file__).resolve().parents[1]
MBIT = 1e6 / 8
GBIT = 1e9 / 8
FULL_WIRE_OVER_RAW = 0.7836
"""zstd-1 of bf16 weights: benchmarks/results/shardcast-cpu-2core.json `compression`."""


def log(msg: str) -> None:
    print(f"[swarm-sim {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def lognormal_between(rng: random.Random, lo: float, hi: float) -> float:
    """Lognormal with lo and hi at -2 and +2 sigma (median their geometric mean), clipped to them."""
    mu, sigma = math.log(math.sqrt(lo * hi)), math.log(hi / lo) / 4
    return min(hi, max(lo, rng.lognormvariate(mu, sigma)))


def residential(rng: random.Random, name: str, cpu_bps: float) -> Host:
    down = lognormal_between(rng, 50, 1000) * MBIT
    up = lognormal_between(rng, 10, 100) * MBIT
    rtt = lognormal_between(rng, 0.020, 0.200)
    return Host(name, "node", up, down, rtt, cpu=Host(name + "/cpu", "cpu", cpu_bps, math.inf, 0.0))


def delta_ratio() -> tuple[float, str]:
    """full / sparse-delta bytes measured on real RL updates (SmolLM2, bf16, lr 1e-6), else 100."""
    path = REPO / "benchmarks" / "results" / "shardcast_delta-real-cpu-2core.json"
    try:
        doc = json.loads(path.read_text())
        return float(doc["headline_full_over_sparse_bf16_lr1e-6"]), path.name
    except (OSError, KeyError, TypeError, ValueError):
        return 100.0, "assumed (no measurement file)"


def simulate(n: int, relays: int, raw_bytes: float, shard_raw: float, wire_over_raw: float, *, origin_bps: float, relay_bps: float,
             peers: int, churn: float, churn_window_s: float, seed: int, cpu_bps: float, relay_slots: int,
             only_node: Host | None = None, seed_copies: int = 1) -> dict:
    rng = random.Random(seed)
    nshards = math.ceil(raw_bytes / shard_raw)
    raw = [min(shard_raw, raw_bytes - i * shard_raw) for i in range(nshards)]
    wire = [r * wire_over_raw for r in raw]
    origin = Host("origin", "origin", origin_bps, origin_bps, 0.010, seed=SeedOffer(seed_copies) if seed_copies else None)
    relay_hosts = [Host(f"relay{j}", "relay", relay_bps, relay_bps, rng.uniform(0.010, 0.030),
                        cpu=Host(f"relay{j}/cpu", "cpu", 4 * cpu_bps, math.inf, 0.0), max_concurrent=relay_slots)
                   for j in range(relays)]
    nodes = [only_node] if only_node is not None else [residential(rng, f"node{j}", cpu_bps) for j in range(n)]
    sources = {}
    for r in relay_hosts:
        sources[r.name] = ["origin"] + [o.name for o in relay_hosts if o is not r]
    for j, h in enumerate(nodes):
        others = rng.sample(range(len(nodes)), min(peers, len(nodes) - 1) + 1) if len(nodes) > 1 else []
        # With relays, the origin's uplink is theirs (a CDN's shape): nodes list relays and peers.
        upstream = [r.name for r in relay_hosts] or ["origin"]
        sources[h.name] = upstream + [nodes[k].name for k in others if k != j][:peers]
    everyone = [origin] + relay_hosts + nodes
    # Announce at t=0; each fetcher then reads the manifest and /have (two round trips to the origin).
    start = {h.name: (h.rtt + origin.rtt) for h in relay_hosts + nodes}
    for r in relay_hosts:
        assert versions_ok(r)
    leave = {h.name: rng.uniform(0, churn_window_s) for h in nodes if rng.random() < churn} if n > 1 else {}
    # Tick: ~1/20 of a shard's time on a median home uplink (4 MB/s), within [2 ms, 0.5 s].
    dt = min(0.5, max(0.002, wire[0] / 4e6 / 20))
    sim = Swarm(everyone, sources, wire, raw, start, leave, seed=seed, dt=dt)
    sim.run()
    stayed = [h for h in nodes if h.alive]
    done = sorted(h.t_done for h in stayed if h.t_done is not None)
    version_wire = sum(wire)
    return {"latencies": done, "nodes": len(nodes), "left": len(nodes) - len(stayed), "unfinished": len(stayed) - len(done),
            "failed": sum(h.failed is not None for h in stayed), "origin_bytes_over_version": origin.bytes_sent / version_wire,
            "relay_bytes_over_version": sum(r.bytes_sent for r in relay_hosts) / version_wire,
            "peer_bytes_over_version": sum(h.bytes_sent for h in nodes) / version_wire, "shards": nshards,
            "version_wire_bytes": version_wire}


def versions_ok(relay: Host) -> bool:
    """A relay that holds the parent mirrors exactly the announced version (the real rule)."""
    from shardcast.relay import versions_to_mirror

    return versions_to_mirror([0, 1], [0]) == [1]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))
    return sorted(xs)[k]


def loopback(k: int, raw_bytes: float, shard_raw: float, uplink_bps: float, cpu_bps: float, link_bps: float, seed_copies: int,
             parallel: int = 4) -> dict:
    """`benchmarks.shardcast`'s scenario in the model: an origin paced to `uplink_bps`, k client
    processes on one host (each lists the origin and every other client), all of them decoding
    on the host's shared CPU (`cpu_bps` of raw output, calibrated from the 1-client loopback run)."""
    nshards = math.ceil(raw_bytes / shard_raw)
    raw = [min(shard_raw, raw_bytes - i * shard_raw) for i in range(nshards)]
    wire = [r * FULL_WIRE_OVER_RAW for r in raw]
    cpu = Host("host/cpu", "cpu", cpu_bps, math.inf, 0.0)
    origin = Host("origin", "origin", uplink_bps, math.inf, 0.0002, seed=SeedOffer(seed_copies) if seed_copies else None)
    clients = [Host(f"c{j}", "node", link_bps, link_bps, 0.0002, cpu=cpu, parallel=parallel) for j in range(k)]
    sources = {c.name: ["origin"] + [o.name for o in clients if o is not c] for c in clients}
    sim = Swarm([origin] + clients, sources, wire, raw, {}, {}, dt=min(0.05, max(1e-4, raw[0] / min(uplink_bps, cpu_bps) / 50)))
    sim.run()
    done = [c.t_done for c in clients]
    return {"all_done_s": max(done) if None not in done else None, "origin_bytes_over_version": origin.bytes_sent / sum(wire)}


def validate(args) -> None:
    """Model vs a `benchmarks.shardcast --ns ...` result file: same payload, shards, uplink, seeding."""
    real = json.loads(Path(args.validate).read_text())
    raw, shard = real["payload_bytes"], real["shard_bytes"]
    ks = sorted(int(k.split("_")[-2]) for k in real if k.startswith("ours_uplink_") and k.endswith("_s") and k.split("_")[-2].isdigit())
    cpu = raw / real["ours_1_s"]  # calibration: 1 client, no uplink limit, is CPU-bound on this host
    rows = []
    for tag, up in (("", math.inf), ("uplink_", real["uplink_mibps"] * 2**20)):
        for k in ks:
            if f"ours_{tag}{k}_s" not in real:
                continue
            m = loopback(k, raw, shard, up, cpu, 1e12, real.get("super_seed_copies", 0))
            links = loopback(k, raw, shard, up, 1e12, 1e12, real.get("super_seed_copies", 0)) if tag else None
            measured = real[f"ours_{tag}{k}_s"]
            rows.append({"scenario": f"{k} client(s), " + ("loopback" if not tag else f"origin uplink {real['uplink_mibps']:g} MiB/s"),
                         "clients": k, "uplink_mibps": None if not tag else real["uplink_mibps"], "measured_s": measured,
                         "model_s": round(m["all_done_s"], 2), "model_over_measured": round(m["all_done_s"] / measured, 2),
                         "within_25pct": abs(m["all_done_s"] / measured - 1) <= 0.25})
            if links:  # the same scenario with the host's CPU left out of the model: links and policy only
                rows[-1].update(links_only_model_s=round(links["all_done_s"], 2),
                                links_only_over_measured=round(links["all_done_s"] / measured, 2),
                                links_only_within_25pct=abs(links["all_done_s"] / measured - 1) <= 0.25)
            log(f"{rows[-1]['scenario']}: measured {measured:.2f}s, model {m['all_done_s']:.2f}s ({rows[-1]['model_over_measured']}x)"
                + (f", links only {links['all_done_s']:.2f}s ({rows[-1]['links_only_over_measured']}x)" if links else ""))
    out = {"benchmark": "swarm_sim_validation", "real": Path(args.validate).name, "cpu_calibration_mib_s": round(cpu / 2**20, 1),
           "rows": rows, "within_25pct": sum(r["within_25pct"] for r in rows), "of": len(rows),
           "links_only_within_25pct": sum(r.get("links_only_within_25pct", False) for r in rows),
           "links_only_of": sum("links_only_model_s" in r for r in rows)}
    path = Path(args.out or REPO / "benchmarks" / "results" / "swarm_sim_validation-cpu-2core.json")
    path.write_text(json.dumps(out, indent=2) + "\n")
    log(f"wrote {path}")
    print(json.dumps(out))


def summarise(cases: list[dict], head: dict) -> dict:
    """Top-level figures: the 1 GB delta case at its best relay count vs N = 1; origin bytes."""
    cases = sorted(cases, key=lambda c: (c["size_gb"], c["encoding"] != "full", c["relays"]))
    delta1 = [c for c in cases if c["size_gb"] == 1 and c["encoding"] == "delta"]
    best = min(delta1, key=lambda c: c["p99_s"]) if delta1 else None
    return {**head, "cases": cases,
            "p99_ratio_n1000_vs_n1": best["p99_ratio_vs_n1"] if best else None, "best_relays_1gb_delta": best["relays"] if best else None,
            "origin_bytes_over_version": best["origin_bytes_over_version"] if best else None,
            "origin_bytes_over_version_max": max(c["origin_bytes_over_version"] for c in cases),
            "aims": {"p99_ratio_n1000_vs_n1": 3.0, "origin_bytes_over_version": 3.0}}


def merge(args) -> None:
    docs = [json.loads(Path(p).read_text()) for p in args.merge]
    head = {k: v for k, v in docs[-1].items() if k not in ("cases", "sim_total_s") and not k.startswith(("p99_ratio", "best_", "origin_bytes", "aims"))}
    head["sim_total_s"] = round(sum(d.get("sim_total_s", 0) for d in docs), 1)
    head["merged_from"] = [Path(p).name for p in args.merge]
    result = summarise([c for d in docs for c in d["cases"]], head)
    out = Path(args.out or REPO / "benchmarks" / "results" / "swarm_sim.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out}")
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--relays", default="0,4,16")
    ap.add_argument("--sizes-gb", default="1,60")
    ap.add_argument("--origin-gbit", type=float, default=1.0, help="trainer origin's uplink, Gbit/s")
    ap.add_argument("--relay-gbit", type=float, default=10.0, help="each relay's link, Gbit/s")
    ap.add_argument("--relay-slots", type=int, default=64, help="a relay's max concurrent shard bodies (`shardcast serve --max-concurrent`)")
    ap.add_argument("--peers", type=int, default=8, help="random peers each node lists as sources")
    ap.add_argument("--churn", type=float, default=0.05, help="share of nodes that leave mid-fetch")
    ap.add_argument("--cpu-gbs", type=float, default=1.0, help="a node's decode+verify rate, GB/s of raw output")
    ap.add_argument("--shard-mib-1gb", type=float, default=8, help="raw shard size for the 1 GB version")
    ap.add_argument("--shard-mib-60gb", type=float, default=512, help="raw shard size for the 60 GB version")
    ap.add_argument("--n1-trials", type=int, default=40, help="N = 1 runs (one random node alone each)")
    ap.add_argument("--seed-copies", type=int, default=1, help="origin super-seeding: hand-outs per shard (0: serve every request)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--delta-ratio", type=float, default=None, help="full / delta bytes (default: the committed real-RL measurement)")
    ap.add_argument("--delta-ratio-from", default="--delta-ratio", help="where --delta-ratio was measured (recorded in the JSON)")
    ap.add_argument("--encodings", default="full,delta", help="which cases to run (full, delta)")
    ap.add_argument("--merge", nargs="+", default=None, help="combine the cases of earlier result files into --out (no simulation)")
    ap.add_argument("--validate", default=None, help="a `benchmarks.shardcast --ns ...` result JSON: model those loopback scenarios instead")
    args = ap.parse_args()
    logging.getLogger("shardcast").setLevel(logging.ERROR)  # 5% churn: thousands of "dropping source" lines
    if args.validate:
        return validate(args)
    if args.merge:
        return merge(args)
    ratio, ratio_src = delta_ratio() if args.delta_ratio is None else (args.delta_ratio, args.delta_ratio_from)
    log(f"delta = full / {ratio:g} ({ratio_src}); origin {args.origin_gbit} Gbit/s, {args.nodes} nodes, churn {args.churn:.0%}")
    common = dict(origin_bps=args.origin_gbit * GBIT, relay_bps=args.relay_gbit * GBIT, peers=args.peers, cpu_bps=args.cpu_gbs * 1e9,
                  relay_slots=args.relay_slots, seed_copies=args.seed_copies)
    cases, t_all = [], time.perf_counter()
    head = {"benchmark": "swarm_sim", "machine": "cpu-2core (simulated links)", "nodes": args.nodes, "origin_gbit": args.origin_gbit,
              "relay_gbit": args.relay_gbit, "relay_slots": args.relay_slots, "peers_per_node": args.peers, "churn": args.churn,
              "node_cpu_gb_s": args.cpu_gbs, "delta_full_over_sparse": ratio, "delta_ratio_from": ratio_src,
              "full_wire_over_raw": FULL_WIRE_OVER_RAW}
    out = Path(args.out or REPO / "benchmarks" / "results" / "swarm_sim.json")  # rewritten after every case
    for gb in [float(x) for x in args.sizes_gb.split(",")]:
        shard = (args.shard_mib_1gb if gb <= 1 else args.shard_mib_60gb) * 2**20
        for enc, w in (("full", FULL_WIRE_OVER_RAW), ("delta", FULL_WIRE_OVER_RAW / ratio)):
            if enc not in args.encodings.split(","):
                continue
            for r in [int(x) for x in args.relays.split(",")]:
                t0 = time.perf_counter()
                rng = random.Random(args.seed + 7)
                solo = [simulate(1, r, gb * 1e9, shard, w, churn=0.0, churn_window_s=0.0, seed=args.seed + 100 + k,
                                 only_node=residential(rng, "node0", args.cpu_gbs * 1e9), **common)["latencies"][0]
                        for k in range(args.n1_trials)]
                swarm = simulate(args.nodes, r, gb * 1e9, shard, w, churn=args.churn, churn_window_s=statistics.median(solo),
                                 seed=args.seed, **common)
                lat = swarm["latencies"]
                case = {"size_gb": gb, "encoding": enc, "relays": r, "nodes": args.nodes, "shard_mib": shard / 2**20,
                        "shards": swarm["shards"], "version_wire_bytes": round(swarm["version_wire_bytes"]),
                        "p50_s": round(pct(lat, 0.5), 2), "p99_s": round(pct(lat, 0.99), 2), "max_s": round(max(lat), 2) if lat else None,
                        "n1_p50_s": round(pct(solo, 0.5), 2), "n1_p99_s": round(pct(solo, 0.99), 2),
                        "p99_ratio_vs_n1": round(pct(lat, 0.99) / pct(solo, 0.99), 2),
                        "origin_bytes_over_version": round(swarm["origin_bytes_over_version"], 2),
                        "relay_bytes_over_version": round(swarm["relay_bytes_over_version"], 2),
                        "peer_bytes_over_version": round(swarm["peer_bytes_over_version"], 2),
                        "left": swarm["left"], "unfinished": swarm["unfinished"], "failed": swarm["failed"],
                        "sim_s": round(time.perf_counter() - t0, 1)}
                cases.append(case)
                out.write_text(json.dumps(summarise(cases, dict(head, sim_total_s=round(time.perf_counter() - t_all, 1))), indent=2) + "\n")
                log(f"{gb:g} GB {enc}, {r} relays: p50 {case['p50_s']}s p99 {case['p99_s']}s (alone: p50 {case['n1_p50_s']}s "
                    f"p99 {case['n1_p99_s']}s; x{case['p99_ratio_vs_n1']}), origin sent {case['origin_bytes_over_version']}x the version, "
                    f"left {case['left']}, unfinished {case['unfinished']}, sim {case['sim_s']}s")
    result = summarise(cases, dict(head, sim_total_s=round(time.perf_counter() - t_all, 1)))
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
