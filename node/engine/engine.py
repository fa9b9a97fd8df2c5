"""The built-in inference engine: continuous batching over a slot KV cache.

Each `step()` (1) applies weights handed to `load_weights` since the last step, (2) admits
waiting requests into free slots and prefills them, sampling their first token, and (3) decodes
one token for every sequence already running. Requests join and leave between steps, so the batch
is never drained to admit work. Invariant: every generated token records the policy version whose
weights computed it; a weight swap lands only between two steps, and sequences in flight keep their
KV cache (built by the older version) and go on under the new one.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from node.engine.sampling import SamplingParams, sample
from node.model.cache import KVCache
from node.model.checkpoint import load_hf_state_dict
from node.model.qwen3_moe import CausalLM

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
class _Sequence:
    request: Request
    slot: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    experts: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.request.prompt_ids) + len(self.tokens)


class RequestQueue:
    """The request side every built-in engine shares: requests wait in `waiting`, run in `running`,
    and `step()` (the engine's own) returns the completions it finished."""

    waiting: "deque[Request]"
    running: dict
    max_seq_len: int

    def add_request(self, request: Request) -> None:
        if len(request.prompt_ids) == 0 or len(request.prompt_ids) >= self.max_seq_len:
            raise RequestTooLong(f"{request.request_id}: prompt of {len(request.prompt_ids)} tokens, limit {self.max_seq_len - 1}")
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Completion]:
        raise NotImplementedError

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Run `requests` to completion; results in request order."""
        for r in requests:
            self.add_request(r)
        done: dict[str, Completion] = {}
        while self.has_work():
            for c in self.step():
                done[c.request_id] = c
        return [done[r.request_id] for r in requests]


class Engine(RequestQueue):
    def __init__(self, model: CausalLM, max_batch: int = 64, max_seq_len: int | None = None,
                 eos_id: int = 2, decode: Callable[[list[int]], str] | None = None,
                 capture_hidden: bool = False, capture_experts: bool = False, version: int = 0):
        cfg = model.config
        self.model = model.eval()
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len or cfg.max_position_embeddings
        self.eos_id = eos_id
        self.decode = decode
        self.capture_hidden = capture_hidden
        self.capture_experts = capture_experts and cfg.num_experts > 0
        self.version = version
        param = next(model.parameters())
        self.device = param.device
        self.cache = KVCache(cfg.num_hidden_layers, max_batch, cfg.num_key_value_heads, self.max_seq_len,
                             cfg.head_dim, dtype=param.dtype, device=param.device)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, _Sequence] = {}
        self._free = list(range(max_batch - 1, -1, -1))
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None
        self._lock = threading.Lock()
        self.tokens_generated = 0

    # ---- weights -------------------------------------------------------------------------
    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Queue new weights (HF or internal names); they take effect before the next step.
        Safe to call from another thread; a newer pending version replaces an older one."""
        with self._lock:
            self._pending = (state_dict, version)

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            state_dict, version = pending
            load_hf_state_dict(self.model, state_dict)
            self.version = version

    # ---- the loop ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Completion]:
        self._apply_pending()
        # ascending slots let the cache read a contiguous block instead of gathering rows
        decoding = sorted(self.running.values(), key=lambda s: s.slot)
        admitted = []
        self._free.sort(reverse=True)
        while self.waiting and self._free:
            seq = _Sequence(self.waiting.popleft(), self._free.pop())
            self.running[seq.slot] = seq
            admitted.append(seq)
        finished: list[Completion] = []
        if admitted:
            finished += self._prefill(admitted)
        if decoding:
            finished += self._decode(decoding)
        return finished

    def _prefill(self, seqs: list[_Sequence]) -> list[Completion]:
        lens = [len(s.request.prompt_ids) for s in seqs]
        t = max(lens)
        ids = torch.zeros(len(seqs), t, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : lens[i]] = torch.tensor(s.request.prompt_ids)
        positions = torch.arange(t).expand(len(seqs), t)
        last = torch.tensor(lens) - 1
        # logits only where the first token is sampled: [B, T, V] of a 151k vocabulary would not fit
        out = self.model(ids.to(self.device), positions.to(self.device), self.cache, self._slots(seqs), logits_at=last)
        rows = torch.arange(len(seqs))
        for i, s in enumerate(seqs):
            if self.capture_experts:
                s.experts.append(out.routed_experts[i, : lens[i]].cpu())
        return self._advance(seqs, out.logits[:, 0], out.hidden[rows, last])

    def _decode(self, seqs: list[_Sequence]) -> list[Completion]:
        ids = torch.tensor([[s.tokens[-1]] for s in seqs], dtype=torch.long)
        positions = torch.tensor([[s.length - 1] for s in seqs], dtype=torch.long)
        out = self.model(ids.to(self.device), positions.to(self.device), self.cache, self._slots(seqs))
        if self.capture_experts:
            for i, s in enumerate(seqs):
                s.experts.append(out.routed_experts[i].cpu())
        return self._advance(seqs, out.logits[:, 0], out.hidden[:, 0])

    def _slots(self, seqs: list[_Sequence]) -> torch.Tensor:
        return torch.tensor([s.slot for s in seqs], dtype=torch.long, device=self.device)

    def _advance(self, seqs: list[_Sequence], logits: torch.Tensor, hidden: torch.Tensor) -> list[Completion]:
        samples = sample(logits.cpu(), [s.request.params for s in seqs], [s.length for s in seqs])
        hidden = hidden.cpu() if self.capture_hidden else None
        finished = []
        for i, s in enumerate(seqs):
            tok = int(samples.tokens[i])
            s.tokens.append(tok)
            s.logprobs.append(float(samples.logprobs[i]))
            s.versions.append(self.version)
            if hidden is not None:
                s.hidden.append(hidden[i].clone())
            reason = self._finish_reason(s, tok)
            if reason is not None:
                finished.append(self._finish(s, reason))
        self.tokens_generated += len(seqs)
        return finished

    def _finish_reason(self, s: _Sequence, tok: int) -> FinishReason | None:
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

    def _finish(self, s: _Sequence, reason: FinishReason) -> Completion:
        del self.running[s.slot]
        self._free.append(s.slot)
        return Completion(
            request_id=s.request.request_id,
            prompt_ids=list(s.request.prompt_ids),
            token_ids=s.tokens,
            logprobs=s.logprobs,
            versions=s.versions,
            finish_reason=reason,
            hidden=torch.stack(s.hidden) if s.hidden else None,
            routed_experts=torch.cat([e.reshape(-1, *e.shape[-2:]) for e in s.experts])[: s.length - 1] if s.experts else None,
        )
