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
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from tqdm import tqdm

from node.config_flags import Flag
from node.engine import Engine, SamplingParams
from node.envs import DEFAULT_TASK, get_env
from node.envs.evaluate import evaluate
from node.envs.rollout import run_episodes
from node.model.checkpoint import state_dict_to_hf
from node.engine.memory_plan import host_or_gpu_free
from node.model.spec import DTYPES, TINY_MAX_SEQ, TINY_MOE, ModelSpec, TinyMoE, load_model, model_config
from node.roles.memory import local_run_plan
from node.recipe import Recipe
from node.rl.advantages import group_advantages
from node.rl.batch import build_batch
from node.rl.trainer import Trainer, TrainerConfig
from node.rl.warmup import WarmupConfig, task_seed, warm_up
from node.run_config import RunConfig

log = logging.getLogger(__name__)

_RECIPE, _RUN = Recipe.model_fields, RunConfig.model_fields
"""Defaults a network run has too live there (node/recipe.py, node/run_config.py); this run reads them."""


class LocalRunConfig(BaseModel):
    """One train-local run; the defaults are the tiny MoE's recipe (README: reward 0.1 -> 0.9 on reverse in
    500 steps)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, arbitrary_types_allowed=True)
    task: str = DEFAULT_TASK
    """reverse | addition | calculator | reverse-text | arithmetic"""
    model: str = TINY_MOE
    """ModelSpec source: tiny-moe, smollm2-135m-instruct, or an HF-layout directory"""
    max_seq_len: int = Field(TINY_MAX_SEQ, ge=8)
    """engine sequence limit (prompt + completion)"""
    eval_n: int = Field(0, ge=0)
    """held-out tasks scored greedily before, during and after RL (0: none)"""
    eval_every: int = Field(0, ge=0)
    """score the held-out set every n steps (0: only before and after)"""
    steps: int = _RECIPE["steps"]
    prompts: int = _RUN["batch_groups"]
    samples: int = _RUN["group_size"]
    seed: int = _RECIPE["seed"]
    lr: float = _RECIPE["lr"]
    temperature: float = _RECIPE["temperature"]
    updates_per_batch: int = _RECIPE["updates_per_batch"]
    minibatches: int = _RECIPE["minibatches"]
    router_replay: bool = _RECIPE["router_replay"]
    warmup_target: float = _RECIPE["warmup_target"]
    warmup_max_steps: Annotated[int, Flag(cli=False), Field(ge=0)] = WarmupConfig.max_steps
    """supervised warm-up steps at most"""
    warmup_lr: Annotated[float, Flag(cli=False), Field(gt=0)] = WarmupConfig.lr
    """learning rate of the supervised warm-up"""
    hidden: int = _RECIPE["hidden"]
    layers: int = _RECIPE["layers"]
    experts: int = _RECIPE["experts"]
    top_k: int = _RECIPE["top_k"]
    adv_std: Annotated[bool, Flag(cli=False)] = True
    """divide each group's advantages by its reward's standard deviation"""
    sample_lag: int = Field(0, ge=0)
    """sample each step's rollouts from the policy this many versions behind the trainer (0: on-policy);
    emulates a network run's off-policy lag (max_off_policy_steps) in one process"""
    memory_limit_gib: float | None = Field(None, gt=0)
    """the most host RAM this run may plan for, in GiB (default: what is free); the plan is printed at start
    and one that does not fit exits 2 before the model is built"""
    trainer: Annotated[TrainerConfig | None, Flag(cli=False)] = None
    """the optimizer's whole config (default: lr, temperature, updates_per_batch, minibatches and
    router_replay above, the LR decayed over `steps`)"""

    @model_validator(mode="after")
    def _trainer(self) -> "LocalRunConfig":
        if self.trainer is None:
            self.trainer = TrainerConfig(lr=self.lr, decay_steps=self.steps, temperature=self.temperature,
                                         updates_per_batch=self.updates_per_batch, minibatches=self.minibatches,
                                         router_replay=self.router_replay)
        return self

    def tiny(self) -> TinyMoE:
        return TinyMoE(hidden=self.hidden, layers=self.layers, experts=self.experts, top_k=self.top_k, seed=self.seed)

    def warmup(self) -> WarmupConfig:
        return WarmupConfig(target=self.warmup_target, max_steps=self.warmup_max_steps, lr=self.warmup_lr,
                            seed=self.seed)


def run(cfg: LocalRunConfig, out: Path, progress: bool = True) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    env = get_env(cfg.task)
    spec = ModelSpec(source=cfg.model, dtype="float32", max_seq_len=cfg.max_seq_len)  # float32 master weights for AdamW
    plan = local_run_plan(model_config(spec, cfg.tiny()), DTYPES[spec.dtype], cfg.trainer.micro_batch_tokens,
                          cfg.prompts * cfg.samples, cfg.max_seq_len, host_or_gpu_free("cpu", cfg.memory_limit_gib))
    print(plan.describe(), flush=True)
    plan.check()  # before the model exists: one line, exit 2, when it cannot fit
    trainer_cfg = dataclasses.replace(cfg.trainer, micro_batch_tokens=plan.micro_batch_tokens)  # sized to what is free
    loaded = load_model(spec, copies=4, tiny=cfg.tiny())  # weights, gradients and AdamW's two moments
    model, tok = loaded.model, loaded.tokenizer
    engine = Engine(copy.deepcopy(model), max_batch=cfg.prompts * cfg.samples, max_seq_len=cfg.max_seq_len,
                    eos_id=tok.eos_id, decode=tok.decode, capture_experts=cfg.trainer.router_replay)
    t0 = time.time()
    if cfg.model == TINY_MOE:
        warm = warm_up(model, engine, env, tok, cfg.warmup())
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
    trainer = Trainer(model, trainer_cfg)
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


PRETRAINED_DEFAULTS = {"prompts": 4, "samples": 4, "lr": 3e-5, "updates_per_batch": 1, "minibatches": 1,
                       "warmup_target": 0.0, "max_seq_len": 96, "eval_n": 32}
"""A pretrained model's recipe on a 2-core CPU (SmolLM2-135M on reverse-text: held-out 0.136 -> 0.264 in 10
steps, 0.282 in 20; benchmarks/results/logs/train-local-smollm2-reverse-text-r2.log). 16 rollouts per
step, one update: a 135M-parameter step costs ~40-130 s of CPU there. Any other key: LocalRunConfig's."""


def _by_model(name: str) -> tuple[Any, Any]:
    """A flag whose default depends on the model: the tiny MoE's (LocalRunConfig's) or a pretrained one's."""
    field = LocalRunConfig.model_fields[name]
    said = " ".join((field.description or "").split())
    return (field.annotation | None, Field(None, description=f"{said} (default {field.default} tiny, "
                                                             f"{PRETRAINED_DEFAULTS[name]} pretrained)"))


TrainLocalFlags = create_model(
    "TrainLocalFlags", __base__=LocalRunConfig,
    __doc__="`primerl-node train-local`'s flags: LocalRunConfig's, those that differ for a pretrained model unset.",
    out=(Path, Field(description="output directory")),
    threads=(int, Field(0, ge=0, description="torch threads (0 = torch default)")),
    **{name: _by_model(name) for name in PRETRAINED_DEFAULTS})


def register(sub: argparse._SubParsersAction) -> None:
    from node.config_flags import add_flags

    p = sub.add_parser(
        "train-local",
        help="synchronous RL in one process (engine + trainer) on a built-in task",
        description="Synchronous RL on one machine from a randomly initialised tiny MoE. Warm-up: "
                    "supervised next-token training on task demonstrations until greedy reward on 64 "
                    "held-out tasks reaches --warmup-target (a few seconds), then GRPO-style RL. Writes "
                    "OUT/metrics.jsonl, OUT/reward.png, OUT/summary.json and OUT/checkpoint/.",
    )
    add_flags(p, TrainLocalFlags)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from node.config_flags import config_from

    flags = config_from(TrainLocalFlags, args)
    get_env(flags.task)  # unknown task names fail here, before any work
    if flags.threads:
        torch.set_num_threads(flags.threads)
    profile = {} if flags.model == TINY_MOE else PRETRAINED_DEFAULTS
    given = flags.model_dump(exclude={"out", "threads", "trainer"}, exclude_none=True)
    run(LocalRunConfig(**{**profile, **given}), flags.out)
    return 0
