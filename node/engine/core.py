"""The engine loop every built-in engine shares: requests, slots, admission, version swaps, finishing.

Each `step()` (1) applies the policy version handed to `load_weights` since the last step, (2)
admits waiting requests into free cache slots, (3) prefills the admitted requests, sampling their
first token, and (4) decodes one token for every sequence that was already running. Requests join
and leave between steps, so the batch is never drained to admit work. A backend (`Engine` on the CPU,
`CudaEngine` with CUDA graphs, `EPEngine` with experts split over processes) supplies only its
forward passes and sampling (`_prefill`, `_decode`), how a version is checked and copied in
(`_check_weights`, `_swap_weights`), and how a finished sequence's record is read (`_completion`).

Invariants: every generated token records the policy version whose weights computed it; a weight
swap lands only between two steps, and sequences in flight keep their KV cache (built by the older
version) and go on under the new one; a newer pending version replaces an older one not yet applied.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

from node.engine.sampling import SamplingParams
from node.engine.phases import PhaseClock

FinishReason = Literal["eos", "stop", "length"]


class RequestTooLong(ValueError):
    """A prompt that leaves no room to generate within the engine's sequence limit."""


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Completion:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    """Policy version that produced each generated token."""
    finish_reason: FinishReason
    hidden: torch.Tensor | None = None
    """[n_gen, H] final hidden states at the positions that produced each generated token."""
    routed_experts: torch.Tensor | None = None
    """[len(prompt) + n_gen - 1, n_moe_layers, k] experts chosen at every position fed to the model."""


@dataclass
class SlotSequence:
    """A request admitted to cache slot `slot`, and what it has generated so far."""

    request: Request
    slot: int
    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Host-side record (the CPU engine); the CUDA engine keeps these on the device by position."""
    hidden: list[torch.Tensor] = field(default_factory=list)
    experts: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.request.prompt_ids) + len(self.tokens)


class PendingVersion:
    """The newest policy version handed over and not yet applied. `load_weights` runs in another
    thread than `step()` (the inference role's fetch), hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._item: tuple[Any, int] | None = None

    def put(self, weights: Any, version: int) -> None:
        with self._lock:
            self._item = (weights, version)

    def take(self) -> tuple[Any, int] | None:
        with self._lock:
            item, self._item = self._item, None
        return item


class RequestQueue:
    """What every engine in this package shows its callers (`registry.InferenceEngine`): requests
    wait in `waiting`, run in `running`, `step()` returns the completions it finished, and a
    version given to `load_weights` waits in `_pending` until a step applies it."""

    def __init__(self, max_seq_len: int, version: int = -1):
        self.max_seq_len = max_seq_len
        self.version = version
        self.waiting: deque[Request] = deque()
        self.running: dict = {}
        self.tokens_generated = 0
        self._pending = PendingVersion()
        self.on_swap: list[Callable[[int, dict], None]] = []
        """Hooks told (version, {t_applied, apply_s, stage_s, staged_on_device, bytes}) on the engine's thread
        once a version is in the served weights (node/version_trace.py writes them down)."""

    def add_request(self, request: Request) -> None:
        if len(request.prompt_ids) == 0 or len(request.prompt_ids) >= self.max_seq_len:
            raise RequestTooLong(f"{request.request_id}: prompt of {len(request.prompt_ids)} tokens, limit {self.max_seq_len - 1}")
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_work_anywhere(self) -> bool:
        """Whether `generate` steps again (an expert-parallel engine asks every rank)."""
        return self.has_work()

    def step(self) -> list[Completion]:
        raise NotImplementedError

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Run `requests` to completion; results in request order."""
        for r in requests:
            self.add_request(r)
        done: dict[str, Completion] = {}
        while self.has_work_anywhere():
            for c in self.step():
                done[c.request_id] = c
        return [done[r.request_id] for r in requests]

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Queue policy `version` (HF names) to take effect before the next step. Safe to call from
        another thread; a newer pending version replaces an older one."""
        self._pending.put(self._check_weights(state_dict), version)

    def _check_weights(self, state_dict: dict[str, torch.Tensor]) -> Any:
        """What is queued for `state_dict`; a backend that checks at once raises here."""
        return state_dict

    def close(self) -> None:
        """Release what the engine holds (captured graphs, processes); in-process engines may hold nothing."""


class EngineCore(RequestQueue):
    """Continuous batching over `max_batch` cache slots (see the module docstring)."""

    def __init__(self, max_batch: int, max_seq_len: int, eos_id: int, decode: Callable[[list[int]], str] | None,
                 version: int):
        super().__init__(max_seq_len, version)
        self.max_batch = max_batch
        self.eos_id = eos_id
        self.decode = decode
        self.running: dict[int, SlotSequence] = {}
        self._free = list(range(max_batch - 1, -1, -1))
        self.phases = PhaseClock()
        """Wall and CPU seconds of each step's phases (swap, prefill, decode, finish: a finished sequence's
        completion, inside decode or prefill), for the inference role's activity rows (`phases`)."""

    # ---- what a backend supplies ----------------------------------------------------------
    def _prefill(self, seqs: list[SlotSequence]) -> list[Completion]:
        """Run the admitted prompts, sample each one's first token, `_advance` them."""
        raise NotImplementedError

    def _decode(self, seqs: list[SlotSequence]) -> list[Completion]:
        """Feed each running sequence's last token, sample the next, `_advance` them."""
        raise NotImplementedError

    def _swap_weights(self, weights: Any) -> None:
        """Copy a queued version (what `_check_weights` returned) into the served model."""
        raise NotImplementedError

    def _completion(self, s: SlotSequence, reason: FinishReason) -> Completion:
        raise NotImplementedError

    def _admission_open(self) -> bool:
        """Whether waiting requests may be admitted this step (always, unless a backend batches them)."""
        return True

    # ---- the loop ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Completion]:
        with self.phases("swap"):
            self._apply_pending()
        # ascending slots let the cache read a contiguous block instead of gathering rows
        decoding = sorted(self.running.values(), key=lambda s: s.slot)
        return self._run(self._admit(), decoding)

    def _apply_pending(self) -> None:
        pending = self._pending.take()
        if pending is not None:
            weights, version = pending
            self._swap_weights(weights)
            self.version = version
            times = getattr(weights, "times", None)  # a StagedVersion's (node/engine/weight_staging.py)
            row = {"t_applied": time.time(), **(vars(times) if times is not None else {})}
            for hook in self.on_swap:
                hook(version, row)

    def _admit(self) -> list[SlotSequence]:
        admitted: list[SlotSequence] = []
        self._free.sort(reverse=True)
        if not self._admission_open():
            return admitted
        while self.waiting and self._free:
            seq = SlotSequence(self.waiting.popleft(), self._free.pop())
            self.running[seq.slot] = seq
            admitted.append(seq)
        return admitted

    def _run(self, admitted: list[SlotSequence], decoding: list[SlotSequence]) -> list[Completion]:
        """This step's forwards: the admitted requests' prefill, then the running sequences' decode."""
        finished: list[Completion] = []
        if admitted:
            with self.phases("prefill"):
                finished += self._prefill(admitted)
        if decoding:
            with self.phases("decode"):
                finished += self._decode(decoding)
        return finished

    def _advance(self, seqs: list[SlotSequence], tokens: list[int]) -> list[Completion]:
        """Append each sequence's sampled token under the current version; finish those that stop."""
        ending: list[tuple[SlotSequence, FinishReason]] = []
        for s, tok in zip(seqs, tokens):
            s.tokens.append(tok)
            s.versions.append(self.version)
            reason = self._finish_reason(s, tok)
            if reason is not None:
                ending.append((s, reason))
        self.tokens_generated += len(seqs)
        return self._finish(ending) if ending else []

    def _finish_reason(self, s: SlotSequence, tok: int) -> FinishReason | None:
        p = s.request.params
        if tok == self.eos_id:
            return "eos"
        if tok in p.stop_token_ids:
            return "stop"
        if p.stop_strings and self.decode is not None:
            text = self.decode(s.tokens)
            if any(text.endswith(stop) for stop in p.stop_strings):
                return "stop"
        if len(s.tokens) >= p.max_new_tokens or s.length >= self.max_seq_len:
            return "length"
        return None

    def _finish(self, ending: list[tuple[SlotSequence, FinishReason]]) -> list[Completion]:
        for s, _ in ending:
            del self.running[s.slot]
            self._free.append(s.slot)
        with self.phases("finish"):
            return self._completions(ending)

    def _completions(self, ending: list[tuple[SlotSequence, FinishReason]]) -> list[Completion]:
        """The step's finished sequences as completions, in order (a backend may read them back together)."""
        return [self._completion(s, reason) for s, reason in ending]
