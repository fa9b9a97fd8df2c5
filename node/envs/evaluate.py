"""Held-out evaluation: a fixed set of tasks per environment, greedy decoding, mean reward.

The held-out seeds (`EVAL_SEED_BASE + i`) are far from any training seed a run derives from
(run, step, index), and decoding is greedy, so the same weights give the same score before and
after training, on any node.
"""

from __future__ import annotations

from dataclasses import dataclass

from node.engine import Engine, SamplingParams
from node.envs.base import Environment
from node.envs.rollout import run_episodes
from node.model.tokenizer import Tokenizer

EVAL_SEED_BASE = 1 << 40
"""First held-out task seed; training seeds stay far below it."""


@dataclass
class EvalResult:
    mean_reward: float
    rewards: list[float]
    samples: list[tuple[str, str]]
    """(prompt, decoded completion) of the first few tasks, for reading."""


def held_out_seeds(n: int) -> list[int]:
    return [EVAL_SEED_BASE + i for i in range(n)]


def evaluate(engine: Engine, env: Environment, tokenizer: Tokenizer, n: int = 64, keep: int = 4) -> EvalResult:
    """Greedy mean reward of the engine's current weights on the first `n` held-out tasks."""
    episodes = [(f"eval-{s}", env.sample_task(s), SamplingParams(temperature=0.0, seed=s)) for s in held_out_seeds(n)]
    rollouts = run_episodes(engine, env, tokenizer, episodes)
    rewards = [r.reward for r in rollouts]
    samples = [(r.task.prompt, tokenizer.decode(r.completion_ids)) for r in rollouts[:keep]]
    return EvalResult(sum(rewards) / len(rewards), rewards, samples)


def greedy_reward(engine: Engine, env: Environment, tokenizer: Tokenizer, seeds: list[int]) -> float:
    """Greedy mean reward of the engine's current weights on the tasks of `seeds`."""
    episodes = [(f"eval-{s}", env.sample_task(s), SamplingParams(temperature=0.0, seed=s)) for s in seeds]
    rollouts = run_episodes(engine, env, tokenizer, episodes)
    return sum(r.reward for r in rollouts) / len(rollouts)
