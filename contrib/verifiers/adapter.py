"""A verifiers environment (a `Taskset`, played single-turn, or an `Env` with one seat, played over
turns) as one of our environments: `sample_task` picks a taskset row by seed and renders its chat
prompt as text, `respond` and `reward` replay the episode over the transcript (replay.py).

Invariant: reply and reward are pure functions of (task, transcript), computed by the verifiers
code itself, so inference, validator and trainer agree (the validator recomputes the reward).
verifiers' scoring is async; it runs from synchronous code here, also when the caller is inside a
running event loop (the roles call environments from asyncio tasks and from worker threads).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import verifiers.v1 as vf
from verifiers.v1.configs.agent import agent_config_fields

from contrib.verifiers.errors import UnsupportedVerifiersEnv
from contrib.verifiers.replay import AwaitingModel, ChatFormat, ModelTurns, TranscriptMismatch, play
from node.envs.base import Environment, Task

log = logging.getLogger(__name__)
T = TypeVar("T")

POOL_SIZE = 4096
"""Rows taken from an infinite taskset (a bounded one is used whole); a seed picks `seed % rows`."""
DEFAULT_MAX_TURNS = 4
"""Model turns per episode when the env's seat sets no `max_turns`."""


def run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion from synchronous code. Inside a running event loop `asyncio.run`
    would raise, so there it runs on a fresh loop in a worker thread (the caller waits: scoring a
    transcript takes about a millisecond)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifiers") as pool:
        return pool.submit(asyncio.run, coro).result()


class VerifiersEnvironment(Environment):
    cheap_reward = False  # a rubric may call models or run code: the validator's verdict covers it

    def __init__(self, name: str, source: vf.Taskset | vf.Env, max_new_tokens: int = 16,
                 fmt: ChatFormat = ChatFormat(), pool_size: int = POOL_SIZE):
        self.name, self.fmt, self.max_new_tokens = name, fmt, max_new_tokens
        if isinstance(source, vf.Env):
            seats = agent_config_fields(source.config)
            if len(seats) != 1:
                raise UnsupportedVerifiersEnv(f"{name}: env {type(source).__name__} has seats {sorted(seats)}; "
                                              "only envs with one seat (the policy) can be trained here")
            (self.seat, self.seat_config), = seats.items()
            self.env, taskset = source, source.taskset
            self.max_turns = self.seat_config.max_turns or DEFAULT_MAX_TURNS
            self.stop_strings = (fmt.turn_end,) if self.max_turns > 1 else ()
        elif isinstance(source, vf.Taskset):
            self.seat, self.seat_config, self.env, taskset = "agent", vf.AgentConfig(), None, source
            self.max_turns, self.stop_strings = 1, ()
        else:
            raise UnsupportedVerifiersEnv(f"{name}: expected a verifiers Taskset or Env, got {type(source).__name__}")
        self.rows: list[vf.Task] = list(taskset if taskset.bounded else taskset.take(pool_size))
        if not self.rows:
            raise UnsupportedVerifiersEnv(f"{name}: the taskset yields no tasks")
        self._check(self.rows)

    def _check(self, rows: list[vf.Task]) -> None:
        """Refuse, at load, what cannot run here: prompts outside the char alphabet, model judges
        (a reward must not depend on a remote model), rewards that need a sandbox runtime."""
        for row in rows:
            bad = set(self.fmt.prompt(row.data)) - set(self.fmt.alphabet)
            if bad:
                raise UnsupportedVerifiersEnv(f"{self.name}: task {row.data.idx} has characters {sorted(bad)} "
                                              "outside the char tokenizer's alphabet")
        task = rows[0]
        if task.config.judges:
            raise UnsupportedVerifiersEnv(f"{self.name}: model judges are not supported (rewards must be exact)")
        for fn in task.hooks("reward"):
            param = inspect.signature(fn).parameters.get("runtime")
            if param is not None and param.default is inspect.Parameter.empty:
                raise UnsupportedVerifiersEnv(f"{self.name}: reward {fn.__name__} needs a runtime (sandbox)")

    def sample_task(self, seed: int) -> Task:
        index = seed % len(self.rows)
        data = self.rows[index].data
        return Task(f"{self.name}-{index}", self.fmt.prompt(data), str(getattr(data, "answer", "") or ""),
                    {"row": index})

    def _row(self, task: Task) -> vf.Task:
        return self.rows[task.data["row"]]

    def respond(self, task: Task, transcript: str) -> str | None:
        if self.max_turns == 1:
            return None
        turns = ModelTurns(transcript, self.fmt, self.max_turns, open_ended=True)
        try:
            run_coroutine(play(self.env, self._row(task), self.seat, self.seat_config, turns))
        except AwaitingModel as request:
            return request.message
        except Exception as exc:  # a failing env ends its episode, as verifiers records a failed run
            log.warning("%s: env run failed on task %s: %s", self.name, task.task_id, exc)
        return None

    def reward(self, task: Task, transcript: str) -> float:
        turns = ModelTurns(transcript, self.fmt, self.max_turns, open_ended=False)
        try:
            trace = run_coroutine(play(self.env, self._row(task), self.seat, self.seat_config, turns))
        except TranscriptMismatch as exc:
            log.warning("%s: task %s: %s", self.name, task.task_id, exc)
            return 0.0
        except Exception as exc:  # verifiers scores a failed episode as no reward
            log.warning("%s: env run failed on task %s: %s", self.name, task.task_id, exc)
            return 0.0
        return float(trace.reward) if trace is not None else 0.0
