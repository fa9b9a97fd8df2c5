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

    python -m benchmarks.weight_latency --stages [--gib 0.5]

One version of a ~GIB GB bf16 Qwen3-MoE-shaped model through every stage of the path on this
machine, with real parts (the trainer's publication into a store, a `shardcast serve` process on
127.0.0.1, the fetch, a CPU `Engine`): publish (full and delta), fetch split into download / verify /
decode / write (seconds of work summed over the fetch's workers), the fetch of a role beside the
trainer on one host (shared store), load/copy and swap both as main did them (`fetch_policy` cloned
every tensor, the swap stacked experts and loaded: `load_hf_state_dict`) and as now (views over the
payload mapping, checked whole, copied tensor by tensor into the served tensors: `StagedVersion`), and
disk bytes per host per version with every role its own store (main) against one shared store with
retention dropping old payloads. Announce over gossip is the sim's (`--ns 1`; tiny model: a gossip
message's latency does not depend on the model's size).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
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


def swaps(node_dir: Path) -> dict[int, dict]:
    """An inference node's swaps.jsonl by version (the engine's own record: `t_applied`, `apply_s`, `stage_s`)."""
    path = node_dir / "swaps.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return {r["version"]: r for r in rows}


def host_store_bytes(run_dir: Path) -> dict:
    """Disk bytes of every shardcast store of a run on this host (the shared OUT/shardcast, or each role's
    WORKDIR/shardcast), per version held: what one version costs the host's disk."""
    from shardcast.retention import run_bytes
    from shardcast.store import Store

    per_version: dict[int, int] = {}
    total = 0
    for root in [*run_dir.glob("shardcast"), *run_dir.glob("*/shardcast")]:
        store = Store(root)
        for run in store.runs():
            total += run_bytes(store, run)
            for v in store.versions(run):
                per_version[v] = per_version.get(v, 0) + _dir_bytes(store.version_dir(run, v))
    sizes = sorted(per_version.values())
    return {"bytes": total, "versions": len(per_version), "stores": len(list(run_dir.glob("shardcast")))
            + len(list(run_dir.glob("*/shardcast"))),
            "bytes_per_version_median": sizes[len(sizes) // 2] if sizes else None,
            "bytes_per_version_max": sizes[-1] if sizes else None}


def _dir_bytes(d: Path) -> int:
    """Disk blocks of the files under `d` (a publisher's payload is a directory of shard files)."""
    return sum(f.stat().st_blocks * 512 for f in d.rglob("*") if f.is_file()) if d.is_dir() else 0


def stage_model(gib: float):
    """A random bf16 Qwen3-MoE-shaped model of about `gib` GB (8 experts, top-2), and a version one
    optimizer-sized step away (every weight nudged: a dense delta, the worst case for its size)."""
    import torch

    from node.model import CausalLM, ModelConfig

    hidden, layers = 1024, max(1, round(8 * gib / 0.5))
    cfg = ModelConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=2816, moe_intermediate_size=768,
                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                      num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    m0 = CausalLM(cfg).to(torch.bfloat16).eval()
    m1 = copy.deepcopy(m0)
    with torch.no_grad():
        for p in m1.parameters():
            p.add_(torch.randn_like(p) * 1e-3 * p.abs().mean())
    return m0, m1


def stage_figures(gib: float, work: Path) -> dict:
    """The stage-by-stage figures (module docstring)."""
    import asyncio
    import subprocess
    import sys
    import time

    import torch

    from node.engine import Engine
    from node.engine.weight_staging import StagedVersion
    from node.engine.weights import expected_shapes
    from node.model.checkpoint import load_hf_state_dict, state_dict_to_hf
    from node.rl.parallel.publish import publish_model
    from node.sim_procs import free_port
    from protocol.identity import NodeKey
    from shardcast.fetch import fetch_version
    from shardcast.manifest import TrustedPublishers
    from shardcast.publish import PublishOptions
    from shardcast.store import Store

    everything = 1 << 40  # main kept every payload of every version it held
    m0, m1 = stage_model(gib)
    nbytes = sum(t.numel() * t.element_size() for t in state_dict_to_hf(m0).values())
    print(f"stages: a {nbytes / 1e9:.2f} GB bf16 version ({sum(p.numel() for p in m0.parameters()) / 1e6:.0f}M "
          "parameters)", flush=True)
    key, run = NodeKey.generate(), "bench"
    trusted = TrustedPublishers([key.peer_id])
    trainer = Store(work / "trainer" / "shardcast", keep_payloads=everything)
    opts = PublishOptions(keep_last=5)
    out: dict = {"version_bytes": nbytes}
    m2 = copy.deepcopy(m1)
    with torch.no_grad():
        for p in m2.parameters():
            p.add_(torch.randn_like(p) * 1e-3 * p.abs().mean())
    for v, m in enumerate((m0, m1, m2)):
        t0 = time.perf_counter()
        publish_model(m, None, trainer, key, run, v, v - 1 if v else None, opts)
        out[f"publish_{'full' if v == 0 else 'delta'}_s"] = round(time.perf_counter() - t0, 3)
    manifests = [trainer.manifest(run, v).manifest for v in range(3)]
    out["wire_bytes"] = {"full": manifests[0].wire_bytes, "delta": manifests[1].wire_bytes}
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "node.cli", "shardcast", "serve", "--store", str(trainer.root),
                               "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        server.stdout.readline()  # "serving ..." once listening
        url = f"http://127.0.0.1:{port}"

        def fetch(store: Store, v: int):
            t0 = time.perf_counter()
            got = asyncio.run(fetch_version(store, [url], trusted, run, v))
            return got, time.perf_counter() - t0

        # main: the relay, the inference node and the validator each fetch into a store of their own
        own = {role: Store(work / role / "shardcast", keep_payloads=everything) for role in ("relay", "inference", "validator")}
        fetched = {}
        for role, store in own.items():
            for v in range(3):
                fetched[(role, v)] = fetch(store, v)
        got_full, full_s = fetched[("inference", 0)]
        got_delta, delta_s = fetched[("inference", 1)]
        out["fetch_other_host_full"] = {"wall_s": round(full_s, 3), **got_full.stages_s}
        out["fetch_other_host_delta"] = {"wall_s": round(delta_s, 3), **got_delta.stages_s}
        disk_before = {v: sum(_dir_bytes(s.version_dir(run, v)) for s in [trainer, *own.values()]) for v in range(3)}
        # now: every role of the host opens the trainer's store and finds the version there
        shared = Store(trainer.root)
        _, beside_s = fetch(shared, 2)
        out["fetch_beside_trainer_s"] = round(beside_s, 4)
        shared.retain(run, 5)  # what the trainer's publication of v2 does now: the oldest payload goes
        disk_after = {v: _dir_bytes(shared.version_dir(run, v)) for v in range(3)}
    finally:
        server.terminate()
        server.wait(30)
    out["disk_bytes_per_host"] = {
        "before_every_role_own_store": {"full_v0": disk_before[0], "delta_v1": disk_before[1], "delta_v2": disk_before[2]},
        "after_one_shared_store": {"full_v0": disk_after[0], "delta_v1": disk_after[1], "delta_v2": disk_after[2]},
        "note": "after: v0 keeps its wire shards only (payload dropped: 2 newest payloads kept); v1, v2 wire + payload"}
    engine = Engine(copy.deepcopy(m0), max_batch=1, max_seq_len=32, eos_id=-1)
    tensors = got_delta.tensors()
    # main's path: fetch_policy cloned every tensor (on the event loop), the swap stacked experts and loaded
    t0 = time.perf_counter()
    cloned = {k: t.clone() for k, t in tensors.items()}
    t1 = time.perf_counter()
    load_hf_state_dict(engine.model, cloned)
    t2 = time.perf_counter()
    del cloned
    out["load_before"] = {"clone_on_event_loop_s": round(t1 - t0, 3), "swap_s": round(t2 - t1, 3),
                          "total_s": round(t2 - t0, 3)}
    # now: views over the payload mapping, checked whole in load_weights, copied tensor by tensor in the swap
    engine2 = Engine(copy.deepcopy(m0), max_batch=1, max_seq_len=32, eos_id=-1)
    shapes = expected_shapes(engine2.model)
    t0 = time.perf_counter()
    staged = StagedVersion.of(engine2.model, got_delta.tensors(), shapes)
    t1 = time.perf_counter()
    staged.apply()
    t2 = time.perf_counter()
    out["load_after"] = {"check_s": round(t1 - t0, 3), "swap_s": round(t2 - t1, 3), "total_s": round(t2 - t0, 3)}
    same = all(torch.equal(a, b) for a, b in zip(engine.model.state_dict().values(), engine2.model.state_dict().values()))
    out["before_and_after_load_the_same_weights"] = same
    out["notes"] = NOTES
    return out


NOTES = {
    "fetch": "the same fetch code before and after (one download); fetch_other_host_*: stages are seconds of work "
             "summed over the fetch's 4 workers (they overlap); before, a role beside the trainer downloaded like "
             "any host (fetch_other_host_*), now it reads the shared store (fetch_beside_trainer_s)",
    "load_before": "main: fetch_policy cloned every tensor on the event loop, the CPU engine's swap stacked the "
                   "experts (hf_to_internal) and load_state_dict copied them in",
    "load_after": "views over the payload mapping, plan checked whole in load_weights (check_s), each tensor copied "
                  "into its served tensor or expert rows in the swap (swap_s); on a GPU with room the copy is staged "
                  "off the engine thread and the swap is device-to-device (not measured here: no GPU)",
    "disk": "before: trainer, relay, inference node and validator each a store with wire shards + payload of "
            "every version; after: one shared store, payloads of the 2 newest versions only",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", default="1,4,8,16")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", type=Path, help="write the JSON result here too")
    p.add_argument("--stages", action="store_true", help="one ~--gib GB version through every stage (see above)")
    p.add_argument("--gib", type=float, default=0.5)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.stages:
        with tempfile.TemporaryDirectory() as tmp:
            result = {"benchmark": "weight_latency_stages", "machine": f"cpu-{os.cpu_count()}core ({platform.machine()})",
                      "load_avg_1m_before": os.getloadavg()[0], **stage_figures(args.gib, Path(tmp)),
                      "load_avg_1m_after": os.getloadavg()[0]}
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result))
        return
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
