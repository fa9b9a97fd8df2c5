"""Supervised warm-up: a few seconds of next-token training on task demonstrations.

Pure RL from random weights almost never samples a reward signal on these tasks, so
`train-local` first teaches the output format (and a little of the task) by cross-entropy on
(prompt, answer + EOS) pairs, and stops as soon as greedy reward reaches a target. RL then has a
policy whose samples differ in reward within each group, which is all GRPO needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from node.envs.base import Environment
from node.envs.evaluate import greedy_reward
from node.model.checkpoint import state_dict_to_hf
from node.model.qwen3_moe import CausalLM
from node.model.tokenizer import Tokenizer
from node.recipe import DEFAULT as DEFAULT_RECIPE


@dataclass(frozen=True)
class WarmupConfig:
    """When the supervised warm-up stops, and how it steps."""

    target: float = DEFAULT_RECIPE.warmup_target
    """Greedy reward on the held-out tasks that ends it (0: no warm-up, as for a pretrained model)."""
    max_steps: int = 400
    """Supervised steps at most."""
    lr: float = 3e-3
    """AdamW learning rate of the supervised steps."""
    seed: int = 0
    """The run's seed (the demonstrations' tasks derive from it)."""


HELD_OUT = [10**9 + i for i in range(64)]
"""Seeds of the tasks whose greedy reward ends the warm-up."""


def task_seed(run_seed: int, step: int, index: int) -> int:
    """The task seed of prompt `index` of `step` in a run seeded `run_seed`."""
    return (run_seed * 1_000_003 + step) * 10_007 + index


def demonstration_batch(env: Environment, tok: Tokenizer, seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, targets) with targets -100 outside the answer; answers end with EOS."""
    seqs, starts = [], []
    for s in seeds:
        task = env.sample_task(s)
        prompt = task.prompt_ids(tok)
        seqs.append(prompt + tok.encode(task.answer) + [tok.eos_id])
        starts.append(len(prompt))
    t = max(len(s) for s in seqs) - 1
    inputs = torch.full((len(seqs), t), tok.pad_id, dtype=torch.long)
    targets = torch.full((len(seqs), t), -100, dtype=torch.long)
    for i, (seq, p) in enumerate(zip(seqs, starts)):
        seq_t = torch.tensor(seq)
        inputs[i, : len(seq) - 1] = seq_t[:-1]
        targets[i, p - 1 : len(seq) - 1] = seq_t[p:]
    return inputs, targets


def supervised_step(model: CausalLM, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    model.train()
    out = model(inputs)
    loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    model.eval()
    return float(loss.detach())


def warm_up(model: CausalLM, engine: Any, env: Environment, tok: Tokenizer, cfg: WarmupConfig) -> dict:
    """Supervised steps until the greedy reward of `engine` (loaded with the model's weights as version 0
    every 5 steps) reaches cfg.target on the held-out tasks; a pretrained model (target 0) is not re-taught
    the task before RL. `engine`: any engine with `load_weights` that `run_episodes` drives."""
    if cfg.target <= 0:
        return {"warmup_steps": 0, "warmup_greedy_reward": None}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    reward, step = greedy_reward(engine, env, tok, HELD_OUT), 0
    while reward < cfg.target and step < cfg.max_steps:
        inputs, targets = demonstration_batch(env, tok, [task_seed(cfg.seed + 7, step, i) for i in range(64)])
        supervised_step(model, opt, inputs, targets)
        step += 1
        if step % 5 == 0:
            engine.load_weights(state_dict_to_hf(model), version=0)
            reward = greedy_reward(engine, env, tok, HELD_OUT)
    engine.load_weights(state_dict_to_hf(model), version=0)
    return {"warmup_steps": step, "warmup_greedy_reward": reward}
