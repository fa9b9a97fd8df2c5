"""The built-in inference engine on the CPU (or any device torch runs eagerly): continuous batching
over a slot KV cache (`core.EngineCore`), the model's own forward, the seeded sampler on the host.

What this backend supplies to the core: a prefill of the admitted prompts right-padded to [B, T]
with logits only at each row's last prompt position, a one-token decode of the running sequences,
sampling on the host (`sampling.sample`), and a version swap that copies HF-named tensors one by one
into the served tensors (`weight_staging.StagedVersion`; checked whole when `load_weights` is called). Requests, completions and the loop are `core`'s (re-exported here).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

from node.engine.core import Completion, EngineCore, FinishReason, Request, RequestQueue, RequestTooLong, SlotSequence
from node.engine.sampling import sample
from node.model.batching import right_pad
from node.model.cache import KVCache
from node.engine.weight_staging import MirrorPlans, StagedVersion
from node.engine.weights import expected_shapes
from node.model.qwen3_moe import CausalLM

if TYPE_CHECKING:
    from node.engine.registry import EngineSetup

log = logging.getLogger(__name__)

__all__ = ["Completion", "Engine", "FinishReason", "Request", "RequestQueue", "RequestTooLong"]


class Engine(EngineCore):
    def __init__(self, model: CausalLM, max_batch: int = 64, max_seq_len: int | None = None,
                 eos_id: int = 2, decode: Callable[[list[int]], str] | None = None,
                 capture_hidden: bool = False, capture_experts: bool = False, version: int = 0):
        cfg = model.config
        super().__init__(max_batch, max_seq_len or cfg.max_position_embeddings, eos_id, decode, version)
        self.model = model.eval()
        self._shapes = expected_shapes(model)
        self._mirrors = MirrorPlans()  # how a fetched payload's layout maps onto this model, made once
        self.capture_hidden = capture_hidden
        self.capture_experts = capture_experts and cfg.num_experts > 0
        param = next(model.parameters())
        self.device = param.device
        self.cache = KVCache(cfg.num_hidden_layers, max_batch, cfg.num_key_value_heads, self.max_seq_len,
                             cfg.head_dim, dtype=param.dtype, device=param.device)

    @classmethod
    def from_setup(cls, setup: EngineSetup) -> Engine:
        """The registry's factory (`builtin`): the run's model, FP8-quantised as the run prescribes."""
        from node.engine.fp8.model import apply_fp8_mode

        if setup.fp8 != "off":
            log.info("the CPU engine serves FP8 weights (%s) through the reference GEMM (slow: small models)", setup.fp8)
        return cls(apply_fp8_mode(setup.model(), setup.fp8), **setup.engine_kwargs())

    def _check_weights(self, state_dict: dict[str, torch.Tensor]) -> StagedVersion:
        """Checked at once (`WeightsMismatch`: nothing queued, the current version keeps serving)."""
        return StagedVersion.of(self.model, state_dict, self._shapes, mirrors=self._mirrors)

    def _swap_weights(self, staged: StagedVersion) -> None:
        staged.apply(self.version)  # a delta's changes alone, or tensor by tensor from the payload's pages

    def _prefill(self, seqs: list[SlotSequence]) -> list[Completion]:
        lens = [len(s.request.prompt_ids) for s in seqs]
        ids = right_pad([s.request.prompt_ids for s in seqs])
        positions = torch.arange(ids.shape[1]).expand(*ids.shape)
        last = torch.tensor(lens) - 1
        # logits only where the first token is sampled: [B, T, V] of a 151k vocabulary would not fit
        out = self.model(ids.to(self.device), positions.to(self.device), self.cache, self._slots(seqs), logits_at=last)
        if self.capture_experts:
            for i, s in enumerate(seqs):
                s.experts.append(out.routed_experts[i, : lens[i]].cpu())
        return self._sampled(seqs, out.logits[:, 0], out.hidden[torch.arange(len(seqs)), last])

    def _decode(self, seqs: list[SlotSequence]) -> list[Completion]:
        ids = torch.tensor([[s.tokens[-1]] for s in seqs], dtype=torch.long)
        positions = torch.tensor([[s.length - 1] for s in seqs], dtype=torch.long)
        out = self.model(ids.to(self.device), positions.to(self.device), self.cache, self._slots(seqs))
        if self.capture_experts:
            for i, s in enumerate(seqs):
                s.experts.append(out.routed_experts[i].cpu())
        return self._sampled(seqs, out.logits[:, 0], out.hidden[:, 0])

    def _slots(self, seqs: list[SlotSequence]) -> torch.Tensor:
        return torch.tensor([s.slot for s in seqs], dtype=torch.long, device=self.device)

    def _sampled(self, seqs: list[SlotSequence], logits: torch.Tensor, hidden: torch.Tensor) -> list[Completion]:
        """Sample each row's next token on the host, record its log-probability (and hidden state)."""
        samples = sample(logits.cpu(), [s.request.params for s in seqs], [s.length for s in seqs])
        hidden = hidden.cpu() if self.capture_hidden else None
        for i, s in enumerate(seqs):
            s.logprobs.append(float(samples.logprobs[i]))
            if hidden is not None:
                s.hidden.append(hidden[i].clone())
        return self._advance(seqs, [int(t) for t in samples.tokens])

    def _completion(self, s: SlotSequence, reason: FinishReason) -> Completion:
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
