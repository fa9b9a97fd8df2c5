"""The coding environment: hidden tests decide the reward, the tool replies through the sandbox, and
a run (episodes through the engine, then a trainer step) completes on it."""

from __future__ import annotations

import torch

from node.engine import Engine, SamplingParams
from node.envs import get_env
from node.envs.coding import RUN, Coding, last_code
from node.envs.rollout import run_episodes
from node.model import CausalLM, CharTokenizer, ModelConfig
from node.rl.advantages import group_advantages
from node.rl.batch import build_batch
from node.rl.trainer import Trainer, TrainerConfig


def test_reference_solution_gets_full_reward_and_wrong_code_gets_partial_or_none():
    env = get_env("coding")
    for seed in range(5):
        task = env.sample_task(seed)
        assert task == env.sample_task(seed)
        CharTokenizer().encode(task.prompt)  # the prompt is in the tokenizer's alphabet
        assert env.respond(task, task.answer + RUN) is None  # visible examples pass: episode ends
        assert env.reward(task, task.answer + RUN) == 1.0
        assert env.reward(task, "def f(x):\n    return 12345\n" + RUN) < 1.0
    assert env.reward(task, task.answer) == 0.0  # never submitted with #run


def test_second_turn_fixes_the_first_and_the_last_code_counts():
    env = Coding()
    task = env.sample_task(3)
    wrong = "def f(x):\n    return 0\n" + RUN
    reply = env.respond(task, wrong)
    assert reply is not None and reply.startswith("\n#fail:")
    CharTokenizer().encode(reply)
    transcript = wrong + reply + task.answer + RUN
    assert last_code(transcript) == task.answer
    assert env.reward(transcript=transcript, task=task) == 1.0
    assert env.reward(task, transcript + reply + "def f(x):\n    return 0\n" + RUN) < 1.0


def test_hostile_code_gets_zero_and_a_tool_reply_not_a_crash():
    env = Coding()
    task = env.sample_task(1)
    for code in ["import os\nos.system('id')\n", "while True:\n    pass\n", "x = bytearray(2 * 1024**3)\n",
                 "def f(x):\n    return open('/etc/passwd').read()\n", "def f(x:\n"]:
        transcript = code + RUN
        reply = env.respond(task, transcript)
        assert reply is not None and reply.startswith("\n#fail:")
        assert env.reward(task, transcript) == 0.0


def test_a_run_on_the_coding_task_completes():
    tok = CharTokenizer()
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, moe_intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
                      num_experts_per_tok=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = CausalLM(cfg)
    env = Coding(hidden_tests=4)
    env.max_new_tokens = 48
    engine = Engine(model, max_batch=8, eos_id=tok.eos_id, decode=tok.decode, capture_experts=True)
    episodes = [(f"e{i}", env.sample_task(i // 2), SamplingParams(temperature=1.0, seed=i)) for i in range(4)]
    rollouts = run_episodes(engine, env, tok, episodes)
    assert len(rollouts) == 4 and all(r.finish_reason for r in rollouts)
    assert all(0.0 <= r.reward <= 1.0 for r in rollouts)
    advantages = group_advantages(torch.tensor([r.reward for r in rollouts]).view(2, 2)).reshape(-1)
    batch = build_batch(rollouts, advantages.tolist())
    metrics = Trainer(model, TrainerConfig(updates_per_batch=1, minibatches=1)).train_step(batch)
    assert torch.isfinite(torch.tensor(metrics["loss"]))
