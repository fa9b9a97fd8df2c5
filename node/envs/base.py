"""The environment interface: tasks drawn from a seed, exact rewards, optional tool turns.

A single-turn environment only implements `sample_task` and `reward`. A multi-turn environment
also implements `respond`: after each model turn (which ends at EOS or one of `stop_strings`), it
returns the tool's reply to append, or None when the episode is over. Rewards are pure functions
of the task and the transcript, so a validator recomputes them exactly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from node.model.tokenizer import Prompt, Tokenizer


@dataclass(frozen=True)
class Task:
    task_id: str
    prompt: str
    answer: str
    data: dict = field(default_factory=dict)
    system: str | None = None
    """Set for chat tasks: the prompt is then the messages [system, user: prompt], rendered by the
    tokenizer's chat template; None: the prompt is plain text."""

    def as_prompt(self) -> Prompt:
        """Plain text, or chat messages for a chat task."""
        if self.system is None:
            return self.prompt
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.prompt}]

    def prompt_ids(self, tokenizer: Tokenizer) -> list[int]:
        """The prompt as the model sees it (the one place a prompt is built from a task: the rollout
        driver, the trainer, the validator and the warm-up all read it here); text prompts start with
        the tokenizer's BOS convention, chat prompts go through its chat template."""
        return tokenizer.encode_prompt(self.as_prompt())


class Environment(ABC):
    name: str = ""
    max_turns: int = 1
    """Model turns per episode (1 = single-turn)."""
    max_new_tokens: int = 16
    """Length limit of one model turn."""
    stop_strings: tuple[str, ...] = ()
    """Strings that end a model turn (a tool call), besides EOS."""
    cheap_reward: bool = True
    """The reward is cheap to compute: the trainer recomputes it for every rollout it trains on
    instead of trusting the submitted one (False: e.g. rewards that run sandboxed code)."""

    @abstractmethod
    def sample_task(self, seed: int) -> Task:
        """The task for `seed` (derived by the coordinator from run, step and work id)."""

    @abstractmethod
    def reward(self, task: Task, transcript: str) -> float:
        """Reward in [0, 1] for the text after the prompt (model turns and tool replies)."""

    def new_tokens(self, task: Task) -> int:
        """Length limit of one model turn of `task` (default `max_new_tokens`; a task whose answers vary
        in length gives each its own budget). The inference role samples with it and the validator
        holds the `length` finish reason to it, both from the task the seed draws."""
        return self.max_new_tokens

    def respond(self, task: Task, transcript: str) -> str | None:
        """The tool's reply to the model's last turn, or None to end the episode."""
        return None


def position_match(output: str, answer: str) -> float:
    """Share of positions where output and answer agree, over the longer of the two."""
    if not output and not answer:
        return 1.0
    hits = sum(a == b for a, b in zip(output, answer))
    return hits / max(len(output), len(answer))
