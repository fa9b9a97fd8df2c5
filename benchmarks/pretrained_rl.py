"""A real pretrained model learns in the network: SmolLM2-135M-Instruct on reverse-text through `sim`.

    python -m benchmarks.pretrained_rl [--steps 20] [--inference-nodes 2] [--minutes 60] [--device cpu|cuda]

Runs `primerl-node sim`'s network (coordinator, trainer, validator, relay, >= 2 inference nodes, every
work unit verified) with the model spec `smollm2-135m-instruct` (weights hash pinned in the signed
spec), scores the task's held-out set (node/envs/evaluate.py: fixed seeds, greedy) with version 0
before and with the trainer's last published version after, and ends with one JSON line: model,
task, eval_before, eval_after, eval_exact_before / _after (share of held-out tasks answered exactly),
steps, wall_s, rollouts_rejected, mismatch_kl, ... The peer figure is
version 0 itself (eval_before), measured in the same run. Writes OUT/result.json and OUT/curve.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch

from node.engine import Engine
from node.envs import get_env
from node.envs.evaluate import evaluate
from node.model.checkpoint import load_hf_state_dict
from node.model.spec import load_model
from node.sim import PRETRAINED_MAX_SEQ, pretrained_run, run_sim
from node.sim_devices import place
from protocol.model_spec import ModelSpec
from shardcast.codec import unflatten
from shardcast.store import Store

log = logging.getLogger("benchmarks.pretrained_rl")


def held_out(model, tok, task: str, n: int) -> tuple[float, list, float]:
    """(mean greedy reward, samples, share of tasks answered exactly: reward 1, e.g. the whole text reversed)."""
    engine = Engine(model, max_batch=n, max_seq_len=PRETRAINED_MAX_SEQ, eos_id=tok.eos_id, decode=tok.decode)
    result = evaluate(engine, get_env(task), tok, n)
    return result.mean_reward, result.samples, sum(r >= 1.0 for r in result.rewards) / len(result.rewards)


def last_version(out: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """The trainer's last published version, read from its shardcast store (hash-checked on publish)."""
    from node.sim_network import store_of

    store = Store(store_of(out, "trainer"))
    run_id = store.runs()[0]
    v = max(store.complete_versions(run_id))
    signed = store.manifest(run_id, v)
    return v, unflatten(signed.manifest.tensors, store.payload(run_id, v))


def plot(rows: list[dict], evals: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.plot([r["step"] for r in rows], [r["reward_mean"] for r in rows], marker=".", label="sampled reward (T=1)")
    ax.scatter([0, evals["steps"]], [evals["before"], evals["after"]], color="red", zorder=3,
               label="held-out greedy eval")
    ax.set_xlabel("trainer step (policy version)")
    ax.set_ylabel("reward (LCS ratio)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--task", default="reverse-text")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--inference-nodes", type=int, default=2)
    ap.add_argument("--batch-groups", type=int, default=4, help="prompts per trainer step")
    ap.add_argument("--group-size", type=int, default=4, help="samples per prompt")
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--max-off-policy-steps", type=int, default=1,
                    help="k; 0 = synchronous (train-local --sample-lag 1 gained +0.122 / +0.064 in 10 steps against "
                         "+0.144 / +0.141 on-policy: benchmarks/results/train-local-smollm2-recipe-cpu-2core.json)")
    ap.add_argument("--eval-n", type=int, default=32)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the roles run the model (`sim --device`: on a GPU every role shares cuda:0, the "
                         "inference nodes serve with builtin-cuda); the held-out set is scored on the CPU either way")
    ap.add_argument("--minutes", type=float, default=60, help="stop the sim after this long")
    ap.add_argument("--out", type=Path, default=Path("runs/pretrained_rl"))
    ap.add_argument("--result", type=Path, default=None, help="also copy result JSON + curve here (PATH.json/.png)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    t0 = time.time()
    load0 = os.getloadavg()[0]
    loaded = load_model(ModelSpec(source=args.model, dtype="float32", max_seq_len=PRETRAINED_MAX_SEQ))
    before, before_samples, exact_before = held_out(loaded.model, loaded.tokenizer, args.task, args.eval_n)
    log.info("eval before RL: %.4f on %d held-out tasks; e.g. %s", before, args.eval_n, before_samples[:3])
    run = pretrained_run(args.model)
    recipe = {"lr": args.lr, "temperature": 1.0, "updates_per_batch": 1, "minibatches": 1}
    t_sim = time.time()
    summary = run_sim(args.out, inference_nodes=args.inference_nodes, steps=args.steps, task=args.task,
                      batch_groups=args.batch_groups, group_size=args.group_size, timeout_s=args.minutes * 60,
                      max_off_policy_steps=args.max_off_policy_steps,
                      recipe=recipe, model=run["model"],
                      placement=place(args.device, args.inference_nodes),
                      engine="builtin-cuda" if args.device == "cuda" else "builtin",
                      # a 135M model's version loads and prefills take seconds of CPU on a shared 2-core
                      # machine: members get 30 s (not 6 s) of missed heartbeats before they count as dead
                      run={"dead_after_missed": 15})
    sim_s = time.time() - t_sim
    log.info("sim: %s", {k: summary.get(k) for k in ("status", "steps", "rollouts_accepted", "rollouts_rejected")})
    version, state = last_version(args.out)
    load_hf_state_dict(loaded.model, state)
    after, after_samples, exact_after = held_out(loaded.model, loaded.tokenizer, args.task, args.eval_n)
    log.info("eval after RL (v%d): %.4f; e.g. %s", version, after, after_samples[:3])
    rows = [json.loads(x) for x in (args.out / "metrics.jsonl").read_text().splitlines()]
    kls = [r["mismatch_kl"] for r in rows if "mismatch_kl" in r]
    result = {
        "benchmark": "pretrained_rl",
        "machine": "cpu-2core" if args.device == "cpu" else f"1x {torch.cuda.get_device_name(0)} (every role on it)",
        "model": args.model, "task": args.task,
        "weights_hash_v0": run["model"]["weights_hash"], "eval_n": args.eval_n,
        "eval_before": round(before, 4), "eval_after": round(after, 4), "eval_gain": round(after - before, 4),
        "eval_exact_before": round(exact_before, 4), "eval_exact_after": round(exact_after, 4),
        "ratio_after_over_before": round(after / before, 3) if before else None,
        "eval_version": version, "steps": summary["steps"], "steps_target": args.steps, "status": summary["status"],
        "wall_s": round(time.time() - t0, 1), "sim_wall_s": round(sim_s, 1),
        "inference_nodes": summary["inference_nodes"], "prompts_per_step": args.batch_groups,
        "group_size": args.group_size, "lr": args.lr, "temperature": 1.0,
        "max_off_policy_steps": args.max_off_policy_steps,
        "rollouts_accepted": summary["rollouts_accepted"], "rollouts_rejected": summary["rollouts_rejected"],
        "rollouts_lost": summary["rollouts_lost"], "rollouts_duplicated": summary["rollouts_duplicated"],
        "max_off_policy_seen": summary["max_off_policy_seen"],
        "mismatch_kl": round(sum(kls) / len(kls), 8) if kls else None, "mismatch_kl_max": max(kls) if kls else None,
        "reward_first": summary["reward_first"], "reward_last5": summary["reward_last5"],
        "samples_before": before_samples[:3], "samples_after": after_samples[:3],
        "load_avg_1m_start": round(load0, 2), "load_avg_1m_end": round(os.getloadavg()[0], 2),
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    plot(rows, {"before": before, "after": after, "steps": version}, args.out / "curve.png",
         f"{args.model} on {args.task} in the network ({summary['steps']} steps, {result['sim_wall_s']:.0f} s)")
    if args.result is not None:
        args.result.with_suffix(".json").write_text(json.dumps(result) + "\n")
        (args.result.with_suffix(".png")).write_bytes((args.out / "curve.png").read_bytes())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
