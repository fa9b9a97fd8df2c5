"""Two small environments written with the `verifiers` (0.4, `verifiers.v1`) API, sized for the
char-level model: a taskset of digit strings to reverse, played single-turn, and an `Env` that
plays the same taskset over several turns, answering each attempt with per-position feedback.

Both are learnable in minutes by the tiny model (`primerl-node sim --task verifiers:digit-reverse`)
and every character they produce is in the char tokenizer's alphabet. This module is also a
verifiers taskset package: `__all__` exports exactly one `Taskset` and one `Env`, so verifiers'
own loader resolves the taskset id `TASKSET_ID` to them once this module is imported.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator

from pydantic import Field

import verifiers.v1 as vf

TASKSET_ID = "primerl_verifiers_examples"
"""This module as a verifiers taskset id. verifiers resolves an id by importing it as a top-level
module (a dotted path fails its lookup), so the module is also registered under this flat name."""
sys.modules.setdefault(TASKSET_ID, sys.modules[__name__])


class DigitTasksetConfig(vf.TasksetConfig):
    size: int = Field(4096, ge=1)
    """Tasks in the taskset (drawn once from `seed`)."""
    min_len: int = Field(3, ge=1)
    """Fewest digits in a task."""
    max_len: int = Field(6, ge=1, le=12)
    """Most digits in a task."""
    seed: int = 0
    """Seed of the generator that draws the tasks."""


class DigitData(vf.TaskData):
    answer: str
    """The digits reversed."""


def position_share(reply: str, answer: str) -> float:
    """Share of positions where reply and answer agree, over the longer of the two."""
    if not reply and not answer:
        return 1.0
    return sum(a == b for a, b in zip(reply, answer)) / max(len(reply), len(answer))


class DigitTask(vf.Task[DigitData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def reversed_digits(self, trace: vf.Trace) -> float:
        """Share of correct positions in the final reply (1.0 only when exact and of the right length)."""
        return position_share(trace.last_reply, self.data.answer)


class DigitTaskset(vf.Taskset[DigitTask, DigitTasksetConfig]):
    """'12345' -> '54321'; the prompt is the digit string itself (no system prompt)."""

    def load(self) -> Iterator[DigitTask]:
        rng = random.Random(self.config.seed)
        for i in range(self.config.size):
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(self.config.min_len,
                                                                                  self.config.max_len)))
            yield DigitTask(DigitData(name=f"digits-{i}", prompt=digits, answer=digits[::-1]), self.config.task)


def feedback(reply: str, answer: str) -> str:
    """'+' for each right digit, '-' for each wrong or missing one, then '?' per extra character."""
    marks = "".join("+" if i < len(reply) and reply[i] == c else "-" for i, c in enumerate(answer))
    return marks + "?" * max(0, len(reply) - len(answer))


class FeedbackEnvConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig(max_turns=3)
    """The one seat: the policy being trained; `max_turns` caps the attempts."""


class ReverseWithFeedbackEnv(vf.Env[FeedbackEnvConfig]):
    """Multi-turn: after each wrong attempt the env replies with `feedback`; the episode ends at the
    first exact answer or when the solver's turns run out. The task's reward scores the last reply."""

    async def run(self, task: DigitTask, agents: vf.Agents) -> None:
        async with agents.solver.interaction(task) as chat:
            attempt = await chat.turn()  # the prompted task speaks first: take the opening reply
            while not attempt.terminated and attempt.last_reply != task.data.answer:
                attempt = await chat.turn(feedback(attempt.last_reply, task.data.answer))
        chat.trace.record_metric("attempts", float(chat.trace.num_turns))


def digit_reverse(**config) -> DigitTaskset:
    """The single-turn example (`verifiers:digit-reverse`)."""
    return DigitTaskset(DigitTasksetConfig(id=TASKSET_ID, **config))


def reverse_with_feedback(**config) -> ReverseWithFeedbackEnv:
    """The multi-turn example (`verifiers:digit-reverse-feedback`)."""
    return ReverseWithFeedbackEnv(FeedbackEnvConfig(taskset={"id": TASKSET_ID, **config}))


__all__ = ["DigitTaskset", "ReverseWithFeedbackEnv", "DigitTask", "digit_reverse", "reverse_with_feedback"]
