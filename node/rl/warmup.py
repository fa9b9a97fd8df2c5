"""Supervised warm-up: a few seconds of next-token training on task demonstrations.

Pure RL from random weights almost never samples a reward signal on these tasks, so
`train-local` first teaches the output format (and a little of the task) by cross-entropy on
(prompt, answer + EOS) pairs, and stops as soon as greedy reward reaches a target. RL then has a
policy whose samples differ in reward within each group, which is all GRPO needs.
"""

from __future__ import annotations

import torch

from node.envs.base import Environment
from node.model.qwen3_moe import CausalLM
from node.model.tokenizer import Tokenizer


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
