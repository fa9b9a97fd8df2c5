import pytest
import torch

from node.engine import Engine, SamplingParams
from node.envs import UnknownTask, get_env
from node.envs.calculator import calculate
from node.envs.rollout import run_episodes
from node.model import CausalLM, CharTokenizer, ModelConfig


def test_reverse_reward_is_the_share_of_correct_positions():
    env = get_env("reverse")
    task = env.sample_task(3)
    assert task == env.sample_task(3) and task.prompt.endswith(">")
    assert env.reward(task, task.answer) == 1.0
    wrong_last = task.answer[:-1] + ("0" if task.answer[-1] != "0" else "1")
    assert env.reward(task, wrong_last) == pytest.approx((len(task.answer) - 1) / len(task.answer))
    assert env.reward(task, task.answer + "99") < 1.0
    assert env.reward(task, "") == 0.0


def test_addition_reward_is_exact_or_partial():
    env = get_env("addition")
    task = env.sample_task(11)
    a, b = task.data["a"], task.data["b"]
    assert task.prompt == f"{a}+{b}=" and env.reward(task, str(a + b)) == 1.0
    assert 0 <= env.reward(task, str(a + b + 1)) < 1.0


def test_calculator_tool_evaluates_only_arithmetic():
    assert calculate("12*3+4") == 40 and calculate("2-3*4") == -10
    for bad in ["", "*2", "2**3", "__import__('os')", "2+", "1/0"]:
        assert calculate(bad) is None
    env = get_env("calculator")
    task = env.sample_task(0)
    assert env.respond(task, "<2*3>") == "=6;"
    assert env.respond(task, "<2/3>") is None  # not a tool call the tool accepts: episode ends
    assert env.respond(task, "hello") is None
    a, b = task.data["a"], task.data["b"]
    assert env.reward(task, f"<{a}*{b}>={a * b};{a * b}") == 1.0
    assert env.reward(task, f"{a * b}") == 0.5  # right, but without using the tool
    assert env.reward(task, f"<{a}*{b}>={a * b};{a * b + 1}") == 0.0


def test_unknown_task_name_fails_clearly():
    with pytest.raises(UnknownTask, match="unknown task 'sort'.*reverse"):
        get_env("sort")


def test_multi_turn_episode_masks_tool_tokens_out_of_the_loss():
    """A tiny model taught one calculator transcript plays it through the engine: the tool's reply
    is spliced in between two model turns and kept out of the loss."""
    torch.manual_seed(0)
    env, tok = get_env("calculator"), CharTokenizer()
    task = env.sample_task(5)
    a, b = task.data["a"], task.data["b"]
    model_turns = [f"<{a}*{b}>", f"{a * b}"]
    tool = f"={a * b};"
    seq = tok.encode(task.prompt, bos=True) + tok.encode(model_turns[0] + tool + model_turns[1]) + [tok.eos_id]
    model = CausalLM(ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, head_dim=16, max_position_embeddings=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([seq])
    for _ in range(150):
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).logits[0], ids[0, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    engine = Engine(model.eval(), max_batch=2, eos_id=tok.eos_id, decode=tok.decode)
    (r,) = run_episodes(engine, env, tok, [("e", task, SamplingParams(temperature=0.0))])
    assert tok.decode(r.completion_ids) == model_turns[0] + tool + model_turns[1]
    assert r.reward == 1.0 and len(r.turns) == 2 and r.finish_reason == "eos"
    n0, nt = len(model_turns[0]), len(tool)
    assert r.loss_mask == [True] * n0 + [False] * nt + [True] * (len(model_turns[1]) + 1)
    assert all(lp == 0.0 for lp, m in zip(r.logprobs, r.loss_mask) if not m)
    assert all(lp < 0.0 for lp, m in zip(r.logprobs, r.loss_mask) if m)


def test_reverse_text_reward_is_the_lcs_ratio_to_the_reversal():
    env = get_env("reverse-text")
    task = env.sample_task(7)
    assert task == env.sample_task(7) and task.answer == task.prompt[::-1]
    messages = task.as_prompt()
    assert messages[0]["role"] == "system" and "<reversed_text>" in messages[0]["content"]
    assert messages[1] == {"role": "user", "content": task.prompt}
    assert env.reward(task, f"<reversed_text>\n{task.answer}\n</reversed_text>") == 1.0
    assert env.reward(task, task.answer) == 1.0  # untagged answers are scored whole
    assert env.reward(task, "") == 0.0
    half = env.reward(task, f"<reversed_text>{task.answer[: len(task.answer) // 2]}</reversed_text>")
    assert 0.4 < half < 0.9
    assert env.reward(task, task.prompt) < 1.0 or task.prompt == task.answer


def test_arithmetic_reward_parses_the_final_number():
    env = get_env("arithmetic")
    task = env.sample_task(3)
    a, b, op = task.data["a"], task.data["b"], task.data["op"]
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    assert task.prompt == f"What is {a} {op} {b}?" and task.answer == str(value)
    assert env.reward(task, f"First {a} {op} {b}, so the answer is {value}.") == 1.0
    assert env.reward(task, f"The answer is {value}. Then {value + 1}") == 0.0
    assert env.reward(task, "no idea") == 0.0
    assert [env.sample_task(s).prompt for s in range(5)] == [env.sample_task(s).prompt for s in range(5)]


def test_tasks_never_hold_token_ids_prompts_go_through_the_tokenizer():
    tok = CharTokenizer()
    env = get_env("reverse")
    task = env.sample_task(1)
    assert task.prompt_ids(tok) == tok.encode(task.prompt, bos=True)  # text prompts: as before
    chat = get_env("arithmetic")
    t = chat.sample_task(2)
    ids = t.prompt_ids(tok)  # the char tokenizer renders messages as their contents
    assert tok.decode(ids).endswith(t.prompt)


def test_held_out_evaluation_is_greedy_and_repeatable():
    from node.envs.evaluate import EVAL_SEED_BASE, evaluate, held_out_seeds
    from node.rl.warmup import task_seed

    assert min(held_out_seeds(64)) == EVAL_SEED_BASE > task_seed(10, 10_000, 10_000)
    torch.manual_seed(0)
    tok = CharTokenizer()
    model = CausalLM(ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, head_dim=16, max_position_embeddings=64))
    engine = Engine(model.eval(), max_batch=8, eos_id=tok.eos_id, decode=tok.decode)
    first = evaluate(engine, get_env("reverse"), tok, n=8)
    again = evaluate(engine, get_env("reverse"), tok, n=8)
    assert first.rewards == again.rewards and len(first.rewards) == 8


def test_the_long_tailed_task_gives_each_text_its_own_budget_and_rollouts_keep_to_it():
    env = get_env("reverse-text-long")
    tasks = [env.sample_task(s) for s in range(2000)]
    budgets = sorted(env.new_tokens(t) for t in tasks)
    assert budgets[len(budgets) // 2] < 100 and budgets[-1] == 1024  # most short, a tail to the 1,024 cap
    assert all(env.new_tokens(t) == min(1024, 32 + len(t.answer)) for t in tasks[:50])
    assert env.reward(tasks[0], f"<reversed_text>{tasks[0].answer}</reversed_text>") == 1.0
    # the rollout driver samples each episode with its task's budget (the validator's termination check reads
    # the same one): a model that never stops runs exactly to it
    tok = CharTokenizer()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16, model_type="qwen3",
                      max_position_embeddings=512)
    model = CausalLM(cfg)
    short = [t for t in tasks if 32 + len(t.answer) < 60][:2] + [t for t in tasks if 90 < 32 + len(t.answer) < 200][:1]
    episodes = [(f"e{i}", t, SamplingParams(temperature=1.0, seed=i)) for i, t in enumerate(short)]
    never = -1  # an end-of-turn id no token has: every turn ends at its budget
    rollouts = run_episodes(Engine(model, max_batch=4, eos_id=never, decode=tok.decode), env, tok, episodes)
    assert [len(r.completion_ids) for r in rollouts] == [env.new_tokens(t) for t in short]
    assert all(r.finish_reason == "length" for r in rollouts)
