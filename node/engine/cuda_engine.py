"""The built-in CUDA engine: continuous batching with each decode step replayed from a CUDA graph.

Public methods as `Engine` (add_request, has_work, step, generate, load_weights), so the
inference and validator roles take either. What differs is where the work happens:

- Per-slot state lives on the device: the last token, the next position, the temperature, the
  seed of every position (`token_seed`, computed on admission), and the stores a completion is
  read from (log-probabilities, final hidden states, routed experts, by position).
- A decode step gathers that state for the running slots, runs the model (`forward.decode_step`),
  samples with the seeded rule (`device_sampling`), and scatters the results back, all on the
  device. One graph per batch bucket (1, 2, 4, ..., max_batch) is captured on first use; the
  only input that changes between replays is the slot table, padded with a scratch slot.
  The host reads back one int64 per running sequence per step (the sampled tokens: stop checks).
- Prefill is eager, batched by length and chunked to `prefill_tokens` tokens per forward.
- `load_weights` checks names and shapes at once (a mismatch raises `WeightsMismatch` and the
  engine keeps serving the version it has) and copies the tensors into the same storage between
  two steps, so captured graphs read the new weights without re-capture.
Invariants: as `Engine` (a token's version is the one whose weights computed it; a swap lands
only between steps; in-flight sequences keep their KV cache). On a CPU device the same code runs
eagerly (torch reference attention and sampler): `tests/engine/test_cuda_engine.py` checks it
against `Engine`, token for token.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import torch

from node.engine.bucket_graphs import BucketGraphs
from node.engine.cuda_state import (FP8Unsupported, SlotState, WeightsMismatch, check_weights, expected_shapes,
                                     prepare_model)
from node.engine.device_sampling import sample_device
from node.engine.engine import Completion, Engine, Request, RequestQueue, _Sequence
from node.engine.forward import decode_step, prefill_chunk
from node.model.cache import KVCache
from node.model.qwen3_moe import CausalLM

log = logging.getLogger(__name__)

__all__ = ["CudaEngine", "FP8Unsupported", "WeightsMismatch"]


def _use_device(device: str | torch.device) -> None:
    """Make `device` the calling thread's current CUDA device. Triton kernels and graph captures run on the
    current device, which is cuda:0 in every new thread: an engine on cuda:1 called from a worker thread (the
    inference role's asyncio.to_thread) would otherwise launch its kernels on the wrong GPU (seen on the
    H200 pair: "Pointer argument (at 0) cannot be accessed from Triton", "The CUDA Graph is empty")."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def buckets_for(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class CudaEngine(RequestQueue):
    def __init__(self, model: CausalLM, max_batch: int = 64, max_seq_len: int | None = None,
                 eos_id: int = 2, decode=None, capture_hidden: bool = False,  # noqa: ANN001
                 capture_experts: bool = False, version: int = 0, *, fp8: bool | str = False,
                 use_graphs: bool | None = None, prefill_tokens: int = 8192, admit_batch: int | None = None,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None):
        """`device`/`dtype`: move the model there first (on CUDA, bf16 unless `dtype` says otherwise);
        None serves it where it is. `fp8`: True/'all' (decoder projections and experts) or 'experts'."""
        cfg = model.config
        _use_device(device if device is not None else next(model.parameters()).device)
        self._shapes = expected_shapes(model)
        model = prepare_model(model, device, dtype, fp8)
        param = next(model.parameters())
        self.device = param.device
        self.fp8 = fp8
        self.model = model.eval()
        self.max_batch, self.eos_id, self.decode, self.version = max_batch, eos_id, decode, version
        self.max_seq_len = max_seq_len or cfg.max_position_embeddings
        self.capture_hidden = capture_hidden
        self.capture_experts = capture_experts and cfg.num_experts > 0
        # the MoE block's float32 expert path counts rows on the host: only bf16 / FP8 steps capture
        capturable = self.device.type == "cuda" and (param.dtype == torch.bfloat16 or cfg.num_experts == 0)
        if use_graphs and not capturable:
            raise ValueError(f"CUDA graphs need a bf16 (or FP8) model on a CUDA device, not {param.dtype} on {self.device}")
        self.use_graphs = capturable if use_graphs is None else use_graphs
        self.prefill_tokens = prefill_tokens
        self.admit_batch = admit_batch or max(1, max_batch // 8)
        """While sequences are decoding, waiting requests are admitted once this many slots are free
        (or all of them fit): one batched prefill instead of one eager prefill per finished sequence."""
        self.scratch = max_batch  # slot that padding rows of a bucket read and write
        self.cache = KVCache(cfg.num_hidden_layers, max_batch + 1, cfg.num_key_value_heads, self.max_seq_len,
                             cfg.head_dim, dtype=param.dtype, device=self.device)
        self.state = SlotState(cfg, max_batch + 1, self.max_seq_len, param.dtype, self.device,
                               capture_hidden, self.capture_experts)
        self.buckets = buckets_for(max_batch)
        self._slot_buf = torch.full((max_batch,), self.scratch, dtype=torch.long, device=self.device)
        self._tok_out = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self._graphs = BucketGraphs(self.device, self._decode_body, lambda b: self._slot_buf[:b].fill_(self.scratch))
        self.waiting: deque[Request] = deque()
        self.running: dict[int, _Sequence] = {}
        self._free = list(range(max_batch - 1, -1, -1))
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None
        self._lock = threading.Lock()
        self.tokens_generated = 0
        from node.fp8.ops import grouped_backend

        log.info("CudaEngine on %s: %s, graphs %s, grouped GEMM backend %s", self.device,
                 f"fp8 ({'experts' if fp8 == 'experts' else 'all projections'})" if fp8
                 else str(param.dtype).removeprefix("torch."), self.use_graphs,
                 grouped_backend(self.device) if fp8 else "torch")

    # ---- weights -------------------------------------------------------------------------
    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Check HF-named tensors against the served model now (`WeightsMismatch` on any missing,
        unexpected or mis-shaped tensor: nothing is queued and the current version keeps serving);
        queue them to be copied in place before the next step."""
        internal = check_weights(state_dict, self.model.config, self._shapes)
        with self._lock:
            self._pending = (internal, version)

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            internal, version = pending
            with torch.no_grad():
                self.model.load_state_dict(internal, strict=True)  # copies into the existing storage
            self.version = version

    # ---- requests: add_request, has_work, generate from RequestQueue ---------------------------
    def verify_prefill(self, sequences: list[list[int]], prompt_lens: list[int], params: list,
                       with_routes: bool = False) -> list:
        """The validator's batched recomputation under the served weights (`verify.verify_prefill`)."""
        from node.engine.verify import verify_prefill

        _use_device(self.device)
        self._apply_pending()
        return verify_prefill(self.model, sequences, prompt_lens, params, with_routes,
                              batch_tokens=4 * self.prefill_tokens)

    def close(self) -> None:
        self._graphs.clear()

    # ---- the loop ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Completion]:
        _use_device(self.device)
        self._apply_pending()
        decoding = sorted(self.running.values(), key=lambda s: s.slot)
        admitted = []
        self._free.sort(reverse=True)
        ready = not self.running or len(self._free) >= min(self.admit_batch, len(self.waiting))
        while ready and self.waiting and self._free:
            seq = _Sequence(self.waiting.popleft(), self._free.pop())
            self.running[seq.slot] = seq
            self.state.admit(seq.slot, seq.request)
            admitted.append(seq)
        finished: list[Completion] = []
        if admitted:
            finished += self._prefill(admitted)
        if decoding:
            finished += self._decode(decoding)
        return finished

    def _prefill(self, seqs: list[_Sequence]) -> list[Completion]:
        seqs = sorted(seqs, key=lambda s: len(s.request.prompt_ids))
        done: list[tuple[_Sequence, torch.Tensor]] = []  # (sequence, its last prompt row's hidden)
        start = 0
        while start < len(seqs):
            end = start + 1
            while end < len(seqs) and (end + 1 - start) * len(seqs[end].request.prompt_ids) <= self.prefill_tokens:
                end += 1
            done += self._prefill_group(seqs[start:end])
            start = end
        group = [s for s, _ in done]
        hidden = torch.stack([h for _, h in done])
        slots = torch.tensor([s.slot for s in group], device=self.device)
        plen = torch.tensor([len(s.request.prompt_ids) for s in group], device=self.device)
        logits = self.model.lm_head(hidden)
        self.state.sample_first(slots, plen, logits, hidden, [s.request.params.top_p for s in group])
        return self._advance(group, self.state.last_tok[slots].tolist())

    def _prefill_group(self, seqs: list[_Sequence]) -> list[tuple[_Sequence, torch.Tensor]]:
        lens = [len(s.request.prompt_ids) for s in seqs]
        t = max(lens)
        chunk = max(1, min(t, self.prefill_tokens // len(seqs)))
        ids = torch.zeros(len(seqs), t, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : lens[i]] = torch.tensor(s.request.prompt_ids)
        ids = ids.to(self.device)
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        last: list[torch.Tensor | None] = [None] * len(seqs)
        for c0 in range(0, t, chunk):
            c1 = min(t, c0 + chunk)
            pos = torch.arange(c0, c1, device=self.device).expand(len(seqs), c1 - c0)
            hidden, routes = prefill_chunk(self.model, ids[:, c0:c1], pos, self.cache, slots, read_len=c1 if c0 else 0)
            if routes is not None and self.capture_experts:
                self.state.routes[slots[:, None], pos] = routes.to(self.state.routes.dtype)
            for i, n in enumerate(lens):
                if c0 < n <= c1:
                    last[i] = hidden[i, n - 1 - c0]
        return list(zip(seqs, last))  # type: ignore[arg-type]

    def _decode(self, seqs: list[_Sequence]) -> list[Completion]:
        n = len(seqs)
        b = next(x for x in self.buckets if x >= n)
        slots = torch.full((b,), self.scratch, dtype=torch.long)
        slots[:n] = torch.tensor([s.slot for s in seqs])
        if self.use_graphs:
            self._graphs.ensure(b)  # before the slot table is filled: capture runs padding rows only
        self._slot_buf[:b].copy_(slots)
        if self.use_graphs:
            logits = self._graphs.run(b)
        else:
            logits = self._decode_body(b)
        top_p = [i for i, s in enumerate(seqs) if s.request.params.top_p < 1]
        if top_p:  # nucleus rows: re-sample with the sorting sampler, outside the graph
            self.state.resample_top_p(self._slot_buf[:n], logits[:n], top_p, [s.request.params.top_p for s in seqs],
                                      self._tok_out)
        return self._advance(seqs, self._tok_out[:n].tolist())

    def _decode_body(self, b: int) -> torch.Tensor:
        """One decode step for slot table rows [0, b): everything on the device; returns logits."""
        st = self.state
        slots = self._slot_buf[:b]
        pos = st.pos[slots]
        hidden, routes = decode_step(self.model, self.cache, st.last_tok[slots], pos, slots)
        logits = self.model.lm_head(hidden)
        tok, lp, _ = sample_device(logits, st.temp[slots], st.seeds[slots, pos + 1])
        st.record(slots, pos, tok, lp, hidden, routes, self.scratch)
        self._tok_out[:b] = tok
        return logits

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket's graph now (largest first), instead of on first use."""
        _use_device(self.device)
        if self.use_graphs:
            for b in sorted(self.buckets, reverse=True):
                self._graphs.ensure(b)

    def _advance(self, seqs: list[_Sequence], tokens: list[int]) -> list[Completion]:
        finished = []
        for s, tok in zip(seqs, tokens):
            s.tokens.append(tok)
            s.versions.append(self.version)
            reason = Engine._finish_reason(self, s, tok)  # type: ignore[arg-type]
            if reason is not None:
                finished.append(self._finish(s, reason))
        self.tokens_generated += len(seqs)
        return finished

    def _finish(self, s: _Sequence, reason) -> Completion:  # noqa: ANN001
        del self.running[s.slot]
        self._free.append(s.slot)
        plen, n = len(s.request.prompt_ids), len(s.tokens)
        st = self.state
        return Completion(
            request_id=s.request.request_id, prompt_ids=list(s.request.prompt_ids), token_ids=s.tokens,
            logprobs=st.logp[s.slot, plen : plen + n].tolist(), versions=s.versions, finish_reason=reason,
            hidden=st.hidden[s.slot, plen - 1 : plen - 1 + n].clone() if self.capture_hidden else None,
            routed_experts=st.routes[s.slot, : plen + n - 1].long().cpu() if self.capture_experts else None,
        )
