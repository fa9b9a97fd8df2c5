"""Rollouts: episodes of an environment driven through the engine, single- or multi-turn.

All episodes share the engine's running batch: when one model turn ends with a tool call, the
tool's reply is appended and the episode continues as a new request while other episodes keep
decoding; new episodes join between any two steps (`Episodes`). Tool tokens are part of the transcript but never of the loss (`loss_mask` False).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from node.engine import Completion, Engine, Request, SamplingParams
from node.envs.base import Environment, Task
from node.model.routing import RouteShape, encode_routes, rollout_routes
from node.model.tokenizer import Tokenizer
from protocol.messages import RolloutSubmission


@dataclass
class Rollout:
    episode_id: str
    task: Task
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    """Model and tool tokens after the prompt, in order."""
    loss_mask: list[bool] = field(default_factory=list)
    """True where the model produced the token."""
    logprobs: list[float] = field(default_factory=list)
    """Inference logprob of each model token (0.0 on tool tokens)."""
    versions: list[int] = field(default_factory=list)
    """Policy version behind each token (tool tokens carry their turn's last version)."""
    turns: list[Completion] = field(default_factory=list)
    reward: float = 0.0
    finish_reason: str = ""
    routed_experts: torch.Tensor | None = None
    """[len(prompt) + len(completion) - 1, n_moe_layers, k], from the last turn's engine pass."""

    @property
    def min_version(self) -> int:
        return min(v for v, m in zip(self.versions, self.loss_mask) if m)

    def to_submission(self, work_id: int, proof: bytes, engine: str = "builtin",
                      routes: RouteShape | None = None) -> RolloutSubmission:
        """This rollout on the wire. `routes`: the model's route shape when routed experts travel (None: not)."""
        return RolloutSubmission(work_id=work_id, version_runs=RolloutSubmission.runs_of(self.versions),
                                 token_ids=self.completion_ids, logprobs=[min(0.0, x) for x in self.logprobs],
                                 reward=self.reward, proof=proof, finish_reason=self.finish_reason,
                                 sampled=self.loss_mask, engine=engine,
                                 routed_experts=None if routes is None else self.routed_experts_bytes(routes))

    @classmethod
    def from_submission(cls, sub: RolloutSubmission, task: Task, prompt_ids: list[int],
                        routed_experts: torch.Tensor | None = None) -> "Rollout":
        """A submission back as a rollout of `task` (the trainer's view: tokens, mask, logprobs, versions)."""
        return cls(f"{sub.work_id}", task, prompt_ids, list(sub.token_ids), list(sub.sampled or [True] * sub.n_tokens),
                   list(sub.logprobs), sub.token_versions, reward=sub.reward, finish_reason=sub.finish_reason,
                   routed_experts=routed_experts)

    def routed_experts_bytes(self, shape: RouteShape) -> bytes | None:
        """The wire form of the experts each of the prompt + completion - 1 positions was routed to, taken
        turn by turn from the engine passes that sampled the tokens (None if not captured)."""
        routes = rollout_routes([t.routed_experts for t in self.turns])
        if routes is None or routes.shape[0] != len(self.prompt_ids) + len(self.completion_ids) - 1:
            return None
        return encode_routes(routes, shape)


class Episodes:
    """Episodes in flight on one engine, single- or multi-turn: `add` queues an episode, `step` runs
    one engine step and returns the episodes it finished. Episodes may be added between any two steps
    (continuous batching across callers: the inference role admits new work as slots free up). Not
    thread-safe: one thread adds and steps (the engine is not shared either)."""

    def __init__(self, engine: Engine, env: Environment, tokenizer: Tokenizer):
        self.engine, self.env, self.tokenizer = engine, env, tokenizer
        self._live: dict[str, tuple[Rollout, SamplingParams]] = {}

    def __len__(self) -> int:
        """Episodes added and not yet finished."""
        return len(self._live)

    def add(self, episode_id: str, task: Task, params: SamplingParams) -> None:
        if episode_id in self._live:  # its engine requests would collide with the running ones
            raise ValueError(f"episode {episode_id!r} is already in flight")
        params = SamplingParams(temperature=params.temperature, top_p=params.top_p, seed=params.seed,
                                max_new_tokens=self.env.new_tokens(task), stop_token_ids=params.stop_token_ids,
                                stop_strings=self.env.stop_strings)
        rollout = Rollout(episode_id, task, task.prompt_ids(self.tokenizer))
        self._live[episode_id] = (rollout, params)
        self.engine.add_request(Request(f"{episode_id}/0", rollout.prompt_ids, params))

    def advanced(self, finished: list[Rollout]) -> int:
        """Sequences the last `step` advanced: those still running and those it finished."""
        return len(getattr(self.engine, "running", ())) + len(finished)

    def step(self) -> list[Rollout]:
        """One engine step; the episodes whose last turn it finished (rewarded), in completion order."""
        env, tokenizer, finished = self.env, self.tokenizer, []
        for completion in self.engine.step():
            episode_id, turn = completion.request_id.rsplit("/", 1)
            rollout, params = self._live[episode_id]
            _append_turn(rollout, completion)
            reply = None
            if completion.finish_reason == "stop" and int(turn) + 1 < env.max_turns:
                reply = env.respond(rollout.task, tokenizer.decode(rollout.completion_ids))
            room = self.engine.max_seq_len - len(rollout.prompt_ids) - len(rollout.completion_ids) - 1
            if reply is not None and room > len(reply):
                reply_ids = tokenizer.encode(reply)
                rollout.completion_ids += reply_ids
                rollout.loss_mask += [False] * len(reply_ids)
                rollout.logprobs += [0.0] * len(reply_ids)
                rollout.versions += [rollout.versions[-1]] * len(reply_ids)
                self.engine.add_request(Request(f"{episode_id}/{int(turn) + 1}",
                                                rollout.prompt_ids + rollout.completion_ids, params))
                continue
            rollout.reward = float(env.reward(rollout.task, tokenizer.decode(rollout.completion_ids)))
            rollout.finish_reason = completion.finish_reason
            del self._live[episode_id]
            finished.append(rollout)
        return finished


def run_episodes(engine: Engine, env: Environment, tokenizer: Tokenizer,
                 episodes: list[tuple[str, Task, SamplingParams]], tally: dict | None = None) -> list[Rollout]:
    """Play every (episode_id, task, params) to the end; results in input order. `tally`, when given, gets the
    engine's `steps`, the sequences they advanced (`decoding`) and the thread's CPU seconds inside them (`cpu_s`), as
    the inference role counts them."""
    running = Episodes(engine, env, tokenizer)
    for episode_id, task, params in episodes:
        running.add(episode_id, task, params)
    done: dict[str, Rollout] = {}
    while engine.has_work():
        cpu = time.thread_time()
        finished = running.step()
        if tally is not None:
            tally["cpu_s"] = tally.get("cpu_s", 0.0) + time.thread_time() - cpu
        for rollout in finished:
            done[rollout.episode_id] = rollout
        if tally is not None:
            tally["steps"] = tally.get("steps", 0) + 1
            tally["decoding"] = tally.get("decoding", 0) + running.advanced(finished)
    return [done[e[0]] for e in episodes]


def _append_turn(rollout: Rollout, completion: Completion) -> None:
    rollout.turns.append(completion)
    rollout.completion_ids += completion.token_ids
    rollout.loss_mask += [True] * len(completion.token_ids)
    rollout.logprobs += completion.logprobs
    rollout.versions += completion.versions
    rollout.routed_experts = completion.routed_experts
