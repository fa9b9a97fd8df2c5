"""`primerl-node train-local`: engine + trainer in one process, synchronous RL on a built-in task.

One step: sample `prompts` tasks (seeds derived from run seed, step and index) x `samples` each
with the engine, score them, compute group-relative advantages, take the trainer's masked-ratio
updates, and hand the new weights to the engine through `load_weights` (version = step + 1).
The model is a `ModelSpec` source (`--model`): the default randomly initialised tiny MoE first gets
a supervised warm-up (see node/rl/warmup.py); a pretrained checkpoint (e.g. smollm2-135m-instruct)
goes straight to RL. The held-out set (node/envs/evaluate.py, greedy) is scored before RL, every
`eval_every` steps and after the last step.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from node.engine import Engine, Request, SamplingParams
from node.envs import Environment, get_env
from node.envs.evaluate import evaluate
from node.envs.rollout import run_episodes
from node.model.checkpoint import state_dict_to_hf
from node.model.config import ModelConfig
from node.model.qwen3_moe import CausalLM
from node.model.spec import TINY_MOE, ModelSpec, TinyMoE, load_model
from node.model.tokenizer import Tokenizer
from node.rl.advantages import group_advantages
from node.rl.batch import build_batch
from node.rl.trainer import Trainer, TrainerConfig
from node.rl.warmup import demonstration_batch, supervised_step

log = logging.getLogger(__name__)


@dataclass
class LocalRunConfig:
    task: str = "reverse"
    model: str = TINY_MOE
    """ModelSpec source: tiny-moe, smollm2-135m-instruct, or an HF-layout directory."""
    max_seq_len: int = 64
    """Engine sequence limit (prompt + completion)."""
    eval_n: int = 0
    """Held-out tasks scored greedily before, during and after RL (0: none)."""
    eval_every: int = 0
    """Score the held-out set every n steps (0: only before and after)."""
    steps: int = 500
    prompts: int = 64
    samples: int = 8
    seed: int = 0
    warmup_max_steps: int = 400
    warmup_target: float = 0.25
    warmup_lr: float = 3e-3
    hidden: int = 64
    layers: int = 2
    experts: int = 4
    top_k: int = 2
    adv_std: bool = True
    sample_lag: int = 0
    """Sample each step's rollouts from the policy this many versions behind the trainer (0: on-policy);
    emulates a network run's off-policy lag (max_off_policy_steps) in one process."""
    trainer: TrainerConfig = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.trainer = self.trainer or TrainerConfig(decay_steps=self.steps)


def tiny_moe_config(vocab_size: int, hidden: int, layers: int, experts: int, top_k: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                       moe_intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=hidden // 4, num_experts=experts,
                       num_experts_per_tok=top_k, max_position_embeddings=64)


def task_seed(run_seed: int, step: int, index: int) -> int:
    return (run_seed * 1_000_003 + step) * 10_007 + index


def greedy_reward(engine: Engine, env: Environment, tok: Tokenizer, seeds: list[int]) -> float:
    episodes = [(f"eval-{s}", env.sample_task(s), SamplingParams(temperature=0.0, seed=s)) for s in seeds]
    rollouts = run_episodes(engine, env, tok, episodes)
    return sum(r.reward for r in rollouts) / len(rollouts)


def warm_up(model: CausalLM, engine: Engine, env: Environment, tok: Tokenizer, cfg: LocalRunConfig) -> dict:
    """Supervised steps until greedy reward on held-out tasks reaches cfg.warmup_target (0: none, as
    for a pretrained model, which is not re-taught the task before RL)."""
    if cfg.warmup_target <= 0:
        return {"warmup_steps": 0, "warmup_greedy_reward": None}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr)
    held_out = [10**9 + i for i in range(64)]
    reward, step = greedy_reward(engine, env, tok, held_out), 0
    while reward < cfg.warmup_target and step < cfg.warmup_max_steps:
        inputs, targets = demonstration_batch(env, tok, [task_seed(cfg.seed + 7, step, i) for i in range(64)])
        supervised_step(model, opt, inputs, targets)
        step += 1
        if step % 5 == 0:
            engine.load_weights(state_dict_to_hf(model), version=0)
            reward = greedy_reward(engine, env, tok, held_out)
    engine.load_weights(state_dict_to_hf(model), version=0)
    return {"warmup_steps": step, "warmup_greedy_reward": reward}


def run(cfg: LocalRunConfig, out: Path, progress: bool = True) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    env = get_env(cfg.task)
    spec = ModelSpec(source=cfg.model, max_seq_len=cfg.max_seq_len)
    tiny = TinyMoE(hidden=cfg.hidden, layers=cfg.layers, experts=cfg.experts, top_k=cfg.top_k, seed=cfg.seed)
    loaded = load_model(spec, copies=4, tiny=tiny)  # weights, gradients and AdamW's two moments
    model, tok = loaded.model, loaded.tokenizer
    engine = Engine(copy.deepcopy(model), max_batch=cfg.prompts * cfg.samples, max_seq_len=cfg.max_seq_len,
                    eos_id=tok.eos_id, decode=tok.decode, capture_experts=cfg.trainer.router_replay)
    t0 = time.time()
    if cfg.model == TINY_MOE:
        warm = warm_up(model, engine, env, tok, cfg)
        log.info("warm-up: %d supervised steps, greedy reward %s, %.1fs", warm["warmup_steps"],
                 warm["warmup_greedy_reward"], time.time() - t0)
    else:
        warm = {"warmup_steps": 0}
    evals: list[dict] = []

    def score(step: int) -> None:
        if cfg.eval_n:
            t_eval = time.time()
            result = evaluate(engine, env, tok, cfg.eval_n)
            evals.append({"step": step, "eval_reward": result.mean_reward, "eval_s": time.time() - t_eval})
            log.info("eval at step %d: %.4f on %d held-out tasks (%.0fs); e.g. %r", step, result.mean_reward,
                     cfg.eval_n, time.time() - t_eval, result.samples[:2])

    score(0)
    trainer = Trainer(model, cfg.trainer)
    behind = [{k: t.clone() for k, t in state_dict_to_hf(model).items()}] if cfg.sample_lag else []
    """With sample_lag: the weights of the last sample_lag + 1 versions, the oldest sampled from."""
    metrics: list[dict] = []
    bar = tqdm(range(cfg.steps), desc=f"train-local {cfg.task}", disable=not progress)
    with (out / "metrics.jsonl").open("w") as f:
        for step in bar:
            t_step = time.time()
            episodes = []
            for i in range(cfg.prompts):
                task = env.sample_task(task_seed(cfg.seed, step, i))
                for j in range(cfg.samples):
                    seed = task_seed(cfg.seed, step, i) * 64 + j
                    episodes.append((f"{step}-{i}-{j}", task, SamplingParams(temperature=cfg.trainer.temperature, seed=seed)))
            tokens_before, t_gen = engine.tokens_generated, time.time()
            rollouts = run_episodes(engine, env, tok, episodes)
            gen_s = time.time() - t_gen
            rewards = torch.tensor([r.reward for r in rollouts]).view(cfg.prompts, cfg.samples)
            adv = group_advantages(rewards, normalize_std=cfg.adv_std).flatten().tolist()
            stats = trainer.train_step(build_batch(rollouts, adv, tok.pad_id))
            current = state_dict_to_hf(model)
            due = bool(cfg.eval_every) and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps
            if due or not cfg.sample_lag:
                engine.load_weights(current, version=step + 1)
            if due:
                score(step + 1)
            if cfg.sample_lag:
                behind = (behind + [{k: t.clone() for k, t in current.items()}])[-(cfg.sample_lag + 1):]
                engine.load_weights(behind[0], version=step + 2 - len(behind))
            row = {"step": step, "reward_mean": float(rewards.mean()), "mismatch_kl": stats["mismatch_kl"],
                   "tokens_per_s": (engine.tokens_generated - tokens_before) / gen_s,
                   "completion_tokens": sum(len(r.completion_ids) for r in rollouts) / len(rollouts),
                   "step_time_s": time.time() - t_step, "elapsed_s": time.time() - t0,
                   **{k: v for k, v in stats.items() if k != "mismatch_kl"}}
            if step == 0:
                row.update(warm)
            metrics.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", kl=f"{row['mismatch_kl']:.1e}")
    engine.load_weights(state_dict_to_hf(model), version=cfg.steps)
    score(cfg.steps)
    trainer.save(out / "checkpoint", companions_from=loaded.directory)
    plot_rewards(metrics, out / "reward.png", cfg.task)
    summary = {"task": cfg.task, "model": cfg.model, "steps": cfg.steps, "reward_first": metrics[0]["reward_mean"],
               "eval": evals, "eval_before": evals[0]["eval_reward"] if evals else None,
               "eval_after": evals[-1]["eval_reward"] if evals else None,
               "reward_last5": sum(m["reward_mean"] for m in metrics[-5:]) / min(5, len(metrics)),
               "elapsed_s": time.time() - t0, **warm}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("summary: %s", summary)
    return metrics


def plot_rewards(metrics: list[dict], path: Path, task: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([m["step"] for m in metrics], [m["reward_mean"] for m in metrics], label="mean reward")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1)
    ax.set_title(f"train-local: {task}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


TINY_DEFAULTS = {"prompts": 64, "samples": 8, "lr": 1e-3, "updates_per_batch": 2, "minibatches": 2,
                 "warmup_target": 0.25, "max_seq_len": 64, "eval_n": 0}
"""The tiny MoE's recipe (README: reward 0.1 -> 0.9 on reverse in 500 steps)."""
PRETRAINED_DEFAULTS = {"prompts": 4, "samples": 4, "lr": 3e-5, "updates_per_batch": 1, "minibatches": 1,
                       "warmup_target": 0.0, "max_seq_len": 96, "eval_n": 32}
"""A pretrained model's recipe on a 2-core CPU (SmolLM2-135M on reverse-text: held-out 0.136 -> 0.264 in 10
steps, 0.282 in 20; benchmarks/results/logs/train-local-smollm2-reverse-text-r2.log). 16 rollouts per
step, one update: a 135M-parameter step costs ~40-130 s of CPU there."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-local",
        help="synchronous RL in one process (engine + trainer) on a built-in task",
        description="Synchronous RL on one machine from a randomly initialised tiny MoE. Warm-up: "
                    "supervised next-token training on task demonstrations until greedy reward on 64 "
                    "held-out tasks reaches --warmup-target (a few seconds), then GRPO-style RL. Writes "
                    "OUT/metrics.jsonl, OUT/reward.png, OUT/summary.json and OUT/checkpoint/.",
    )
    p.add_argument("--task", default="reverse", help="reverse | addition | calculator | reverse-text | arithmetic")
    p.add_argument("--model", default=TINY_MOE, help="tiny-moe | smollm2-135m-instruct | an HF-layout directory")
    p.add_argument("--max-seq-len", type=int, default=None, help="engine sequence limit (default 64 tiny, 96 pretrained)")
    p.add_argument("--eval-n", type=int, default=None, help="held-out tasks scored greedily (default 0 tiny, 32 pretrained)")
    p.add_argument("--eval-every", type=int, default=0, help="score the held-out set every n steps")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--updates-per-batch", type=int, default=None, help="default 2 tiny, 1 pretrained")
    p.add_argument("--minibatches", type=int, default=None, help="default 2 tiny, 1 pretrained")
    p.add_argument("--steps", type=int, default=LocalRunConfig.steps, help="RL steps (the LR decays over them)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 64 tiny, 4 pretrained)")
    p.add_argument("--samples", type=int, default=None, help="samples per prompt, the group (default 8 tiny, 4 pretrained)")
    p.add_argument("--lr", type=float, default=None, help="default 1e-3 tiny, 3e-5 pretrained")
    p.add_argument("--warmup-target", type=float, default=None,
                   help="greedy reward that ends the supervised warm-up (default 0.25 tiny; 0 = none, pretrained)")
    p.add_argument("--no-router-replay", action="store_true")
    p.add_argument("--sample-lag", type=int, default=0,
                   help="sample from the policy N versions behind the trainer (a network run's off-policy lag)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    get_env(args.task)  # unknown task names fail here, before any work
    if args.threads:
        torch.set_num_threads(args.threads)
    tiny = args.model == TINY_MOE
    d = TINY_DEFAULTS if tiny else PRETRAINED_DEFAULTS
    pick = lambda name: d[name] if getattr(args, name) is None else getattr(args, name)  # noqa: E731
    cfg = LocalRunConfig(task=args.task, model=args.model, steps=args.steps, prompts=pick("prompts"),
                         samples=pick("samples"), seed=args.seed, warmup_target=pick("warmup_target"),
                         max_seq_len=pick("max_seq_len"), eval_n=pick("eval_n"), eval_every=args.eval_every,
                         sample_lag=args.sample_lag,
                         trainer=TrainerConfig(lr=pick("lr"), decay_steps=args.steps, temperature=args.temperature,
                                               updates_per_batch=pick("updates_per_batch"),
                                               minibatches=pick("minibatches"),
                                               router_replay=not args.no_router_replay))
    run(cfg, Path(args.out))
    return 0
