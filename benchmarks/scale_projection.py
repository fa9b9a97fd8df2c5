"""Step time and weight latency of a 30B and a 1T MoE run with N inference nodes, projected from the
component figures this project measured (benchmarks/results/*.json; nothing here is measured anew).

    python -m benchmarks.scale_projection [--k 1]

A projection, not a measurement: each stage's cost per byte or per token comes from one committed
result (named in `inputs`), and the way they add up is the simple model below. The whole network has
not yet completed a step on GPUs (benchmarks/results/logs/gpu_network-h200x2-attempt1), so no figure
here is checked against a real run at scale. Model, per step of B rollouts:

- train_s    = B * tokens * 6 * active / (MFU * 989 TFLOP/s * trainer GPUs)      (trainer_scale MFU)
- publish_s  = full bf16 bytes / (publish GB/s per trainer host * hosts)           (trainer_scale)
- transfer_s = sparse-delta bytes / link * swarm p99 factor                        (shardcast_delta, swarm_sim)
- apply_s    = full bytes / (fetch+verify+load GB/s * GPUs per node: each rank its own share) (trainer_scale fetch)
- gen_s      = B * completion tokens / (N * node tok/s), node tok/s scaled from the 8-layer 30B-A3B
               shape's measured RL-shaped rate by active parameters per token        (gpu_engine)
- weight latency = publish_s + transfer_s + apply_s
- synchronous step (k = 0) = gen_s + train_s + weight latency; asynchronous (k >= 1) = the largest of
  gen_s, train_s + publish_s, weight latency / k (the off-policy bound lets k versions be in flight).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
H200_BF16_FLOPS = 989e12
"""Dense bf16 peak of one H200 (the figure MFU is quoted against in trainer_scale)."""

MODELS = {  # total and active-per-token parameters; bf16 bytes = 2 * total
    "30B-A3B": {"total": 30.5e9, "active": 3.05e9, "trainer_gpus": 8, "gpus_per_node": 1},
    "1T-A32B": {"total": 1.04e12, "active": 32.6e9, "trainer_gpus": 224, "gpus_per_node": 8},
}
LINKS_GBIT = {"residential 100 Mbit/s": 0.1, "residential 1 Gbit/s": 1.0, "datacenter 100 Gbit/s": 100.0}
MEASURED_SHAPE_ACTIVE = 0.767e9
"""Active compute parameters per token of the 8-layer Qwen3-30B-A3B shape gpu_engine ran (8 x 57M + lm_head)."""


def inputs() -> dict:
    ts = json.loads((RESULTS / "trainer_scale-h200x2.json").read_text())
    ge = json.loads((RESULTS / "gpu_engine-h200-run4.json").read_text())
    sw = json.loads((RESULTS / "swarm_sim.json").read_text())
    sd = json.loads((RESULTS / "shardcast_delta-real-cpu-2core.json").read_text())
    return {
        "mfu": ts["mfu"], "publish_gb_s_per_host": ts["publish_gb_s"],
        "apply_gb_s": round(ts["publish_payload_gb"] / ts["fetch_s"], 3),
        "gen_tok_s_per_gpu_measured_shape": ge["rl_workload_tok_s"], "verify_over_generate": ge["verify_over_generate"],
        "full_over_sparse": sd["headline_full_over_sparse_bf16_lr1e-6"], "swarm_p99_factor": sw["p99_ratio_n1000_vs_n1"],
        "from": {"mfu, publish, apply": "trainer_scale-h200x2.json", "generation, verification": "gpu_engine-h200-run4.json",
                 "sparse delta": "shardcast_delta-real-cpu-2core.json (bf16, lr 1e-6)",
                 "swarm factor": "swarm_sim.json (1 GB delta, N = 1000, 16 relays)"},
    }


def project(model: str, nodes: int, link_gbit: float, k: int, x: dict, rollouts: int = 256,
            prompt: int = 512, completion: int = 1024) -> dict:
    m = MODELS[model]
    full = 2 * m["total"]
    train = rollouts * (prompt + completion) * 6 * m["active"] / (x["mfu"] * H200_BF16_FLOPS * m["trainer_gpus"])
    publish = full / 1e9 / (x["publish_gb_s_per_host"] * max(1, m["trainer_gpus"] // 8))
    transfer = full / x["full_over_sparse"] * 8 / (link_gbit * 1e9) * x["swarm_p99_factor"]
    apply = full / 1e9 / (x["apply_gb_s"] * m["gpus_per_node"])  # each rank of an EP node applies its own share
    node_tok_s = m["gpus_per_node"] * x["gen_tok_s_per_gpu_measured_shape"] * MEASURED_SHAPE_ACTIVE / m["active"]
    gen = rollouts * completion / (nodes * node_tok_s)
    latency = publish + transfer + apply
    stages = {"generation": gen, "train + publish": train + publish, "weight latency / k": latency / max(k, 1)}
    step_async = max(stages.values())
    return {"model": model, "nodes": nodes, "link_gbit": link_gbit, "train_s": round(train, 1),
            "publish_s": round(publish, 1), "transfer_s": round(transfer, 1), "apply_s": round(apply, 1),
            "gen_s": round(gen, 1), "weight_latency_s": round(latency, 1),
            "step_sync_s": round(gen + train + latency, 1), "step_async_s": round(step_async, 1),
            "bottleneck": max(stages, key=stages.get)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=1, help="max_off_policy_steps of the asynchronous run")
    p.add_argument("--out", type=Path, default=RESULTS / "scale_projection.json")
    args = p.parse_args()
    x = inputs()
    rows = [project(model, n, gbit, args.k, x) for model in MODELS for n in (16, 128, 1000) for gbit in LINKS_GBIT.values()]
    names = {v: k for k, v in LINKS_GBIT.items()}
    print("| model | nodes | link | train s | publish s | transfer s | apply s | gen s | weight latency s | "
          "step k=0 s | step k=%d s | bottleneck |" % args.k)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['nodes']} | {names[r['link_gbit']]} | {r['train_s']} | {r['publish_s']} | "
              f"{r['transfer_s']} | {r['apply_s']} | {r['gen_s']} | {r['weight_latency_s']} | {r['step_sync_s']} | "
              f"{r['step_async_s']} | {r['bottleneck']} |")
    result = {"benchmark": "scale_projection", "kind": "projection from committed measurements", "k": args.k,
              "inputs": x, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({"benchmark": "scale_projection", "k": args.k, "rows": len(rows),
                      "step_async_s_1T_1000_nodes_1gbit": next(r["step_async_s"] for r in rows if r["model"] == "1T-A32B"
                                                               and r["nodes"] == 1000 and r["link_gbit"] == 1.0)}))


if __name__ == "__main__":
    main()
