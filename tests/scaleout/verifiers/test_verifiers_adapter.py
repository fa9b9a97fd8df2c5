"""verifiers (0.4, `verifiers.v1`) environments behind our environment interface: rewards equal
verifiers' own scoring of the same replies, multi-turn feedback flows through the rollout driver
and stays out of the loss, and bad task names fail with typed errors."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

vf = pytest.importorskip("verifiers.v1", reason="verifiers is not installed: pip install 'primerl-node[verifiers]'")

from contrib.verifiers import (UnsupportedVerifiersEnv, VerifiersEnvNotFound, VerifiersNotInstalled,  # noqa: E402
                               load_environment)
from contrib.verifiers.adapter import VerifiersEnvironment  # noqa: E402
from contrib.verifiers.examples import DigitData, DigitTask, DigitTaskset, DigitTasksetConfig, feedback  # noqa: E402
from node.engine import Engine, SamplingParams  # noqa: E402
from node.envs import UnknownTask, get_env  # noqa: E402
from node.envs.rollout import run_episodes  # noqa: E402
from node.model import CausalLM, CharTokenizer, ModelConfig  # noqa: E402

SINGLE, MULTI = "verifiers:digit-reverse", "verifiers:digit-reverse-feedback"


def verifiers_score(row: vf.Task, turns: list[tuple[str, str]]) -> float:
    """verifiers' own scoring of a conversation, built here from wire-format messages:
    `turns` is [(user, assistant), ...] after the row's prompt (the first user text is the prompt)."""
    messages = [{"role": "user", "content": row.data.prompt}]
    for i, (user, reply) in enumerate(turns):
        if i:
            messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": reply})
    nodes = [{"parent": i - 1 if i else None, "message": m, "sampled": m["role"] == "assistant"}
             for i, m in enumerate(messages)]
    trace = vf.Trace.model_validate({"task": {"type": "DigitTask", "data": row.data.model_dump()},
                                     "agent": {"config": {}}, "nodes": nodes})
    asyncio.run(row.score(trace))
    return trace.reward


def test_single_turn_rewards_equal_verifiers_own_scoring():
    env = get_env(SINGLE)
    assert env is get_env(SINGLE)  # loaded once per process: roles call get_env per rollout
    assert env.max_turns == 1 and env.stop_strings == ()
    for seed in range(12):
        task = env.sample_task(seed)
        row = env.rows[task.data["row"]]
        assert task.prompt == row.data.prompt + ">" and task.answer == row.data.prompt[::-1]
        for reply in [task.answer, task.answer[:2], task.answer + "7", task.answer[::-1], "", "abc"]:
            want = verifiers_score(row, [("", reply)])
            assert env.reward(task, reply) == pytest.approx(want, abs=1e-12)
    task = env.sample_task(3)
    assert env.reward(task, task.answer) == 1.0 and env.reward(task, "") == 0.0  # the rubric is not constant


def test_reward_is_computed_inside_a_running_event_loop():
    """The validator calls environments from asyncio code; asyncio.run there would raise."""
    env = get_env(MULTI)
    task = env.sample_task(5)
    transcript = "0.\n" + feedback("0", task.answer) + ">" + task.answer

    async def in_loop():
        return env.reward(task, transcript), env.respond(task, "0.")

    reward, reply = asyncio.run(in_loop())
    assert reward == env.reward(task, transcript) == 1.0
    assert reply == env.respond(task, "0.") == "\n" + feedback("0", task.answer) + ">"


def test_multi_turn_feedback_replays_the_env_and_scores_the_last_reply():
    env = get_env(MULTI)
    assert env.max_turns == 3 and env.stop_strings == (".",)
    task = env.sample_task(11)
    row = env.rows[task.data["row"]]
    answer = task.answer
    first, second = "1" * len(answer), answer[:-1] + ("0" if answer[-1] != "0" else "1")
    reply1 = env.respond(task, first + ".")
    assert reply1 == f"\n{feedback(first, answer)}>"
    reply2 = env.respond(task, first + "." + reply1 + second + ".")
    assert reply2 == f"\n{feedback(second, answer)}>" and reply2.count("-") == 1
    # the third turn is the last (max_turns 3): no reply, whatever it is
    transcript = first + "." + reply1 + second + "." + reply2 + answer
    assert env.respond(task, transcript + ".") is None
    expected = verifiers_score(row, [("", first), (feedback(first, answer), second), (feedback(second, answer), answer)])
    assert env.reward(task, transcript) == expected == 1.0
    # solved on the first try: the env ends the episode, scored on that reply
    assert env.respond(task, answer + ".") is None and env.reward(task, answer + ".") == 1.0
    # an env message the env did not send: the transcript is not this env's
    assert env.reward(task, first + ".\n+++>" + answer) == 0.0
    partial = first + "." + reply1 + second
    assert env.reward(task, partial) == pytest.approx(verifiers_score(row, [("", first), (reply1[1:-1], second)]))


def test_multi_turn_episode_flows_through_the_engine_with_feedback_out_of_the_loss():
    """A tiny model taught one two-attempt transcript plays it through the rollout driver: the env's
    feedback is spliced in between the turns, kept out of the loss, and the reward is verifiers'."""
    torch.manual_seed(0)
    env, tok = get_env(MULTI), CharTokenizer()
    task = env.sample_task(2)
    wrong = task.answer[1:] + task.answer[0]
    reply = "\n" + feedback(wrong, task.answer) + ">"
    seq = tok.encode(task.prompt, bos=True) + tok.encode(wrong + "." + reply + task.answer) + [tok.eos_id]
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
    assert tok.decode(r.completion_ids) == wrong + "." + reply + task.answer
    assert len(r.turns) == 2 and r.finish_reason == "eos" and r.reward == 1.0
    n1, nr = len(wrong) + 1, len(reply)
    assert r.loss_mask == [True] * n1 + [False] * nr + [True] * (len(task.answer) + 1)


def test_bad_task_names_fail_with_typed_errors(monkeypatch):
    with pytest.raises(VerifiersEnvNotFound, match="registered id"):
        get_env("verifiers:no-such-env")
    with pytest.raises(VerifiersEnvNotFound, match="module 'no_such_module' not found"):
        get_env("verifiers:no_such_module:env")
    with pytest.raises(VerifiersEnvNotFound, match="has no 'nothing'"):
        get_env("verifiers:contrib.verifiers.examples:nothing")
    with pytest.raises(UnsupportedVerifiersEnv, match="expected a verifiers Taskset or Env"):
        get_env("verifiers:contrib.verifiers.examples:TASKSET_ID")
    with pytest.raises(UnsupportedVerifiersEnv, match="zero-argument"):
        get_env("verifiers:contrib.verifiers.examples:feedback")
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # as if verifiers were not installed
    with pytest.raises(VerifiersNotInstalled, match="pip install"):
        load_environment("digit-reverse", max_new_tokens=8)
    assert issubclass(VerifiersNotInstalled, UnknownTask)  # a launch reports it like any unknown task


def test_prompts_the_char_tokenizer_cannot_encode_are_refused_at_load():
    class Accented(DigitTaskset):
        def load(self):
            yield DigitTask(DigitData(prompt="caf\u00e9", answer="x"), self.config.task)

    with pytest.raises(UnsupportedVerifiersEnv, match="outside the char tokenizer's alphabet"):
        VerifiersEnvironment("verifiers:test", Accented(DigitTasksetConfig(id="t")))
    fine = VerifiersEnvironment("verifiers:test", DigitTaskset(DigitTasksetConfig(id="t", size=3)))
    assert len(fine.rows) == 3 and fine.sample_task(4).data == {"row": 1}


def test_a_few_shot_chat_prompt_renders_as_a_transcript_and_scores_the_reply():
    class FewShot(DigitTaskset):
        def load(self):
            shots = [{"role": "user", "content": "12"}, {"role": "assistant", "content": "21"},
                     {"role": "user", "content": "345"}]
            yield DigitTask(DigitData(prompt=shots, system_prompt="rev", answer="543"), self.config.task)

    env = VerifiersEnvironment("verifiers:test", FewShot(DigitTasksetConfig(id="t")))
    task = env.sample_task(0)
    assert task.prompt == "rev\n12>21.\n345>"
    assert env.reward(task, "543") == 1.0 and env.reward(task, "21") == 0.0  # the shot's reply is not the model's
