"""Single-turn tasks with exact, cheap rewards: digit-string reversal and multi-digit addition."""

from __future__ import annotations

import random

from node.envs.base import Environment, Task, position_match


class Reverse(Environment):
    """'12345>' -> '54321': reward is the share of correct positions."""

    name = "reverse"

    def __init__(self, min_len: int = 3, max_len: int = 6):
        self.min_len, self.max_len = min_len, max_len
        self.max_new_tokens = max_len + 2

    def sample_task(self, seed: int) -> Task:
        rng = random.Random(seed)
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(self.min_len, self.max_len)))
        return Task(f"reverse-{seed}", f"{digits}>", digits[::-1], {"digits": digits})

    def reward(self, task: Task, transcript: str) -> float:
        return position_match(transcript, task.answer)


class Addition(Environment):
    """'123+4567=' -> '4690': 1.0 when exact, else the share of correct positions (right-aligned) / 2."""

    name = "addition"

    def __init__(self, max_digits: int = 3):
        self.max_digits = max_digits
        self.max_new_tokens = max_digits + 3

    def sample_task(self, seed: int) -> Task:
        rng = random.Random(seed)
        a = rng.randint(0, 10**self.max_digits - 1)
        b = rng.randint(0, 10**self.max_digits - 1)
        return Task(f"addition-{seed}", f"{a}+{b}=", str(a + b), {"a": a, "b": b})

    def reward(self, task: Task, transcript: str) -> float:
        if transcript == task.answer:
            return 1.0
        return 0.5 * position_match(transcript[::-1], task.answer[::-1])
