"""Two user tasks (`module:attr`, node/envs/user.py) that give the cross-device fixture the lengths the
built-in character tasks lack, inside the tiny MoE's 64-position window: `Echo`, prompts of 2 to 24
characters and completions of up to 36 tokens (two 32-token proof chunks); `Chatter`, three model
turns that end on any of six common characters, each answered by a two-character tool reply (tokens
the model did not sample, `sampled` False). Rewards are pure functions of task and transcript.
"""

from __future__ import annotations

import random
import string

from node.envs.base import Environment, Task

ALPHABET = string.ascii_lowercase + " "


class Echo(Environment):
    name = "echo"
    max_new_tokens = 36

    def sample_task(self, seed: int) -> Task:
        rng = random.Random(seed)
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 24)))
        return Task(f"echo-{seed}", text, text)

    def reward(self, task: Task, transcript: str) -> float:
        return float(transcript.startswith(task.answer))


class Chatter(Environment):
    name = "chatter"
    max_turns = 3
    max_new_tokens = 12
    stop_strings = ("e", "a", "o", " ", ".", "1")

    def sample_task(self, seed: int) -> Task:
        rng = random.Random(seed)
        return Task(f"chatter-{seed}", "".join(rng.choice(ALPHABET) for _ in range(rng.randint(3, 10))), "")

    def respond(self, task: Task, transcript: str) -> str | None:
        return "ok"

    def reward(self, task: Task, transcript: str) -> float:
        return min(1.0, transcript.count("ok") / 2)
