"""Replaying a verifiers episode over a transcript: the model's turns come from our rollout, the
env's control flow (`Env.run`) and the scoring (`Task.score`, `Env.finalize`) are verifiers' own.

verifiers drives an episode as a coroutine that awaits model turns (`Interaction.turn`); our rollout
driver works the other way round (the engine finishes a turn, then asks the environment for its
reply). Replay reconciles the two and keeps no state between calls: to answer after turn k it runs
the env from the start, handing it turns 1..k cut out of the transcript, and stops at the first
turn it cannot hand over; the message the env sent with that request is the reply. The reward is
the same replay run to its end, then verifiers' scoring. Both are pure functions of (task,
transcript), which is what lets a validator recompute them.

Invariant: a transcript is `turn (turn_end follow_up turn)*`, where every `follow_up` is the env's
message rendered by `ChatFormat.follow_up`; a transcript that does not have this shape was not
produced by this environment (`TranscriptMismatch`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import verifiers.v1 as vf
from verifiers.v1.types import content_text

from node.model.tokenizer import _CHARS


@dataclass(frozen=True)
class ChatFormat:
    """How chat messages become the char model's text (every character must be in its alphabet)."""

    cue: str = ">"
    """Ends every rendered user message: the model's turn starts after it."""
    turn_end: str = "."
    """A model turn that ends with this asks for the env's reply (a stop string); EOS ends the episode."""
    alphabet: str = _CHARS
    """Characters the model's tokenizer encodes; an env message's others are rendered as '?'."""

    def prompt(self, data: vf.TaskData) -> str:
        """The system prompt (if any) on its own line, then the prompt. A chat prompt (few-shot turns)
        is rendered as a transcript would be: user text + cue, assistant text + turn_end, each
        later user message on a new line; the model's turn follows the last cue."""
        text = f"{data.system_prompt}\n" if data.system_prompt else ""
        if not isinstance(data.prompt, list):
            return f"{text}{data.prompt or ''}{self.cue}"
        for i, message in enumerate(data.prompt):
            body = content_text(message.content) or ""
            if message.role == "system":
                text += f"{body}\n"
            elif message.role == "assistant":
                text += f"{body}{self.turn_end}"
            else:
                new_line = "\n" if i > 0 and data.prompt[i - 1].role == "assistant" else ""
                text += f"{new_line}{body}{self.cue}"
        return text

    def follow_up(self, message: str | vf.Messages) -> str:
        """An env message after a model turn: a new line, its text, the cue."""
        text = message if isinstance(message, str) else "\n".join(content_text(m.content) for m in message)
        return "".join(c if c in self.alphabet else "?" for c in f"\n{text}{self.cue}")


class TranscriptMismatch(ValueError):
    """The transcript holds text this environment could not have produced."""


class AwaitingModel(BaseException):
    """The env asked for a model turn the transcript does not have yet (carries the env's message).
    A BaseException, like asyncio's CancelledError, so env code catching Exception lets it through."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ModelTurns:
    """The model's side of one replay: its turns, cut out of the transcript in order."""

    def __init__(self, transcript: str, fmt: ChatFormat, max_turns: int, open_ended: bool):
        self.text, self.fmt, self.max_turns = transcript, fmt, max_turns
        self.open_ended = open_ended
        """True when answering the last turn (respond): a request past the transcript is the reply
        sought; False when scoring: the transcript is the whole episode and the run ends there."""
        self.pos = 0
        self.count = 0

    def next(self, message: str | vf.Messages | None) -> str | None:
        """The model's reply to `message` (None: the opening turn), or None when the run ends here."""
        if message is not None:
            if self.count >= self.max_turns:
                return None
            rendered = self.fmt.follow_up(message)
            if self.pos == len(self.text):
                if self.open_ended:
                    raise AwaitingModel(rendered)
                return None
            if not self.text.startswith(rendered, self.pos):
                raise TranscriptMismatch(f"expected the env's message {rendered!r} at character {self.pos}")
            self.pos += len(rendered)
        end = self.text.find(self.fmt.turn_end, self.pos) if self.fmt.turn_end else -1
        if end < 0:
            reply, self.pos = self.text[self.pos:], len(self.text)
        else:  # the stop string ends the turn and, as in the OpenAI API, is not part of the reply
            reply, self.pos = self.text[self.pos:end], end + len(self.fmt.turn_end)
        self.count += 1
        return reply


def new_trace(task: vf.Task, seat: str, config: vf.AgentConfig) -> vf.Trace:
    """A trace holding the task's opening messages (system prompt, then the prompt)."""
    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=vf.AgentInfo(config=config, name=seat))
    if task.data.system_prompt:
        _append(trace, vf.SystemMessage(content=task.data.system_prompt))
    prompt = task.data.prompt
    for message in [vf.UserMessage(content=prompt)] if isinstance(prompt, str) else (prompt or []):
        _append(trace, message)
    return trace


def _append(trace: vf.Trace, message, sampled: bool = False) -> None:
    parent = len(trace.nodes) - 1 if trace.nodes else None
    trace.nodes.append(vf.MessageNode(parent=parent, message=message, sampled=sampled))


class ReplayInteraction:
    """`Interaction`'s surface used by env code (`turn`, `trace`), answered from `ModelTurns`."""

    def __init__(self, trace: vf.Trace, turns: ModelTurns):
        self.trace, self._turns, self._over = trace, turns, False

    async def turn(self, message: str | vf.Messages | None = None) -> vf.Segment:
        if self._over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        reply = self._turns.next(message)
        if reply is None:
            self._over = True
            return vf.Segment(messages=[], terminated=True)
        if message is not None:
            for m in [vf.UserMessage(content=message)] if isinstance(message, str) else message:
                _append(self.trace, m)
        answer = vf.AssistantMessage(content=reply)
        _append(self.trace, answer, sampled=True)
        return vf.Segment(messages=[answer])


class ReplayAgent:
    """The one seat's `Agent` surface (`run`, `interaction`): the policy, played by the transcript."""

    def __init__(self, name: str, config: vf.AgentConfig, turns: ModelTurns, finished: list[vf.Trace]):
        self.name, self.config, self._turns, self._finished = name, config, turns, finished
        self.trainable = True

    async def run(self, task: vf.Task) -> vf.Trace:
        """A whole run of a chat harness: one model turn, then scoring."""
        async with self.interaction(task) as chat:
            await chat.turn()
        return chat.trace

    @contextlib.asynccontextmanager
    async def interaction(self, task: vf.Task) -> AsyncIterator[ReplayInteraction]:
        chat = ReplayInteraction(new_trace(task, self.name, self.config), self._turns)
        yield chat  # an exception (AwaitingModel, a failing env) propagates unscored, as in verifiers
        chat.trace.stop("user_closed")
        await task.score(chat.trace)  # the task's @vf.reward / @vf.metric functions
        chat.trace.is_completed = chat.trace.ok = True
        self._finished.append(chat.trace)


class ReplayAgents:
    """`Agents` for an env with one seat: attribute access by the seat's name."""

    def __init__(self, agent: ReplayAgent):
        self._agent = agent

    def __getattr__(self, name: str) -> ReplayAgent:
        if name != self._agent.name:
            raise AttributeError(f"this env has one seat, {self._agent.name!r}; no agent {name!r}")
        return self._agent


async def play(env: vf.Env | None, task: vf.Task, seat: str, config: vf.AgentConfig,
               turns: ModelTurns) -> vf.Trace | None:
    """Replay one episode: `env.setup`, `env.run`, `env.finalize` (or, with no env, one plain run of
    the seat as verifiers' SingleAgentEnv does). Returns the seat's scored trace."""
    finished: list[vf.Trace] = []
    agents = ReplayAgents(ReplayAgent(seat, config, turns, finished))
    if env is None:
        await agents.__getattr__(seat).run(task)
        return finished[-1]
    await env.setup(agents)
    await env.run(task, agents)
    if not finished:
        return None
    episode = vf.Episode(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                         traces=finished, ok=True)
    await env.finalize(task, episode)
    return episode.traces[-1]
