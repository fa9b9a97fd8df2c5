"""The built-in CUDA engine: continuous batching with each decode step replayed from a CUDA graph.

The loop (admission, version swaps between steps, finish reasons, `generate`) is `core.EngineCore`'s,
as for `Engine`, so the inference and validator roles take either. What this backend supplies is
where the work happens:

- Per-slot state lives on the device: the last token, the next position, the temperature, the
  seed of every position (`token_seed`, computed on admission), and the stores a completion is
  read from (log-probabilities, final hidden states, routed experts, by position).
- A decode step gathers that state for the running slots, runs the model (`forward.decode_step`),
  samples with the seeded rule (`device_sampling`), and scatters the results back, all on the
  device. One graph per batch bucket (1, 2, 4, ..., max_batch) is captured on first use; the
  only input that changes between replays is the slot table, padded with a scratch slot.
  The host reads back one int64 per running sequence per step (the sampled tokens: stop checks).
- Prefill is eager: the admitted prompts packed end to end, `prefill_tokens` real tokens per forward (no padding:
  `forward.prefill_packed`); a prompt longer than that alone, in right-padded chunks that read the cache.
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
from typing import TYPE_CHECKING

import torch

from node.engine.bucket_graphs import BucketGraphs
from node.engine.core import Completion, EngineCore, FinishReason, SlotSequence
from node.engine.cuda_state import FP8Unsupported, SlotState, prepare_model
from node.engine.device_sampling import sample_device
from node.engine.forward import decode_step, prefill_chunk, prefill_packed
from node.engine.pinned_ring import PinnedRing
from node.engine.weight_staging import MirrorPlans, StagedVersion
from node.engine.weights import WeightsMismatch, expected_shapes
from node.model.batching import right_pad, token_budget_groups
from node.model.cache import KVCache
from node.model.packed import Packed, to_device
from node.model.qwen3_moe import CausalLM

if TYPE_CHECKING:
    from node.engine.registry import EngineSetup

log = logging.getLogger(__name__)

__all__ = ["CudaEngine", "FP8Unsupported", "WeightsMismatch"]


def _use_device(device: str | torch.device) -> None:
    """Make `device` the calling thread's current CUDA device. Triton kernels and graph captures run on the
    current device, which is cuda:0 in every new thread: an engine on cuda:1 called from a worker thread (the
    inference role's asyncio.to_thread) would otherwise launch its kernels on the wrong GPU (seen on the
    H200 pair: "Pointer argument (at 0) cannot be accessed from Triton", "The CUDA Graph is empty")."""
    device = torch.device(device)
    if device.type == "cuda":  # plain "cuda" is the process's default GPU (torch wants an index here)
        torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())


def buckets_for(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class CudaEngine(EngineCore):
    def __init__(self, model: CausalLM, max_batch: int = 64, max_seq_len: int | None = None,
                 eos_id: int = 2, decode=None, capture_hidden: bool = False,  # noqa: ANN001
                 capture_experts: bool = False, version: int = 0, *, fp8: bool | str = False,
                 use_graphs: bool | None = None, prefill_tokens: int = 8192, admit_batch: int | None = None,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None, pack_prefill: bool = True):
        """`device`/`dtype`: move the model there first (on CUDA, bf16 unless `dtype` says otherwise);
        None serves it where it is. `fp8`: True/'all' (decoder projections and experts) or 'experts'.
        `pack_prefill`: admitted prompts end to end (False: right-padded groups, the way before session 42, kept as
        `benchmarks.engine_prefill`'s peer)."""
        cfg = model.config
        super().__init__(max_batch, max_seq_len or cfg.max_position_embeddings, eos_id, decode, version)
        _use_device(device if device is not None else next(model.parameters()).device)
        self._shapes = expected_shapes(model)
        self._ring: PinnedRing | None = None
        self._mirrors = MirrorPlans()  # how a fetched payload's layout maps onto this model, made once
        """Pinned host buffers every version's tensors pass through on their way to the GPU."""
        model = prepare_model(model, device, dtype, fp8)
        param = next(model.parameters())
        self.device = param.device
        self.fp8 = fp8
        self.model = model.eval()
        self.capture_hidden = capture_hidden
        self.capture_experts = capture_experts and cfg.num_experts > 0
        # the MoE block's float32 expert path counts rows on the host: only bf16 / FP8 steps capture
        capturable = self.device.type == "cuda" and (param.dtype == torch.bfloat16 or cfg.num_experts == 0)
        if use_graphs and not capturable:
            raise ValueError(f"CUDA graphs need a bf16 (or FP8) model on a CUDA device, not {param.dtype} on {self.device}")
        self.use_graphs = capturable if use_graphs is None else use_graphs
        self.prefill_tokens = prefill_tokens
        self.pack_prefill = pack_prefill
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
        from node.fp8.ops import grouped_backend

        log.info("CudaEngine on %s: %s, graphs %s, grouped GEMM backend %s", self.device,
                 f"fp8 ({'experts' if fp8 == 'experts' else 'all projections'})" if fp8
                 else str(param.dtype).removeprefix("torch."), self.use_graphs,
                 grouped_backend(self.device) if fp8 else "torch")

    @classmethod
    def from_setup(cls, setup: EngineSetup) -> CudaEngine:
        """The registry's factory (`builtin-cuda`): on the node's device, FP8 as the run prescribes, every
        batch bucket's graph captured before the first lease (a few seconds; FP8 ~12 s once)."""
        model = setup.model()
        param = next(model.parameters())
        if param.device.type == "cuda":  # slots from free memory, planned (and refused) before the cache exists
            from node.engine.memory_plan import MAX_SLOTS, plan_on

            setup.max_batch = plan_on(param.device, model.config, setup.max_seq_len, param.dtype,
                                      setup.gpu_memory_share, MAX_SLOTS, setup.min_batch).slots
        # served in the run's dtype (the spec's), never the engine's own default: the validator recomputes in
        # that dtype and picks its tolerances by it, so a float32 run served in bf16 would fail honest work
        engine = cls(model, **setup.engine_kwargs(), fp8={"off": False, "experts": "experts", "all": True}[setup.fp8],
                     device=setup.device, dtype=next(model.parameters()).dtype)
        engine.capture_all()
        return engine

    # ---- weights -------------------------------------------------------------------------
    def _check_weights(self, state_dict: dict[str, torch.Tensor]) -> StagedVersion:
        """Checked against the served model at once (`WeightsMismatch` on any missing, unexpected or
        mis-shaped tensor: nothing is queued and the current version keeps serving), then staged on the
        device tensor by tensor, in the caller's thread, while the engine decodes (`weight_staging`)."""
        _use_device(self.device)
        if self.device.type == "cuda" and self._ring is None:
            self._ring = PinnedRing(self.device)
        return StagedVersion.of(self.model, state_dict, self._shapes, self._ring, mirrors=self._mirrors)

    def _swap_weights(self, staged: StagedVersion) -> None:
        staged.apply(self.version)  # into the existing storage: captured graphs read the new weights

    # ---- the validator's recomputation --------------------------------------------------
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

    # ---- the loop: core.EngineCore's; admission batched, forwards and sampling on the device ----
    def step(self) -> list[Completion]:
        _use_device(self.device)
        return super().step()

    def _admission_open(self) -> bool:
        return not self.running or len(self._free) >= min(self.admit_batch, len(self.waiting))

    def _prefill(self, seqs: list[SlotSequence]) -> list[Completion]:
        for seq in seqs:
            self.state.admit(seq.slot, seq.request)
        done: list[tuple[SlotSequence, torch.Tensor]] = []  # (sequence, its last prompt row's hidden)
        lens = [len(s.request.prompt_ids) for s in seqs]
        for group in token_budget_groups(lens, self.prefill_tokens):
            if self.pack_prefill and sum(lens[i] for i in group) <= self.prefill_tokens:
                done += self._prefill_packed([seqs[i] for i in group])
            else:  # one prompt longer than the budget: in chunks that read the cache
                done += self._prefill_group([seqs[i] for i in group])
        group = [s for s, _ in done]
        hidden = torch.stack([h for _, h in done])
        slots = to_device(torch.tensor([s.slot for s in group]), self.device)
        plen = to_device(torch.tensor([len(s.request.prompt_ids) for s in group]), self.device)
        logits = self.model.lm_head(hidden)
        self.state.sample_first(slots, plen, logits, hidden, [s.request.params.top_p for s in group])
        return self._advance(group, self.state.last_tok[slots].tolist())

    def _prefill_packed(self, seqs: list[SlotSequence]) -> list[tuple[SlotSequence, torch.Tensor]]:
        """The prompts end to end in one forward, no padding (`forward.prefill_packed`)."""
        lens = [len(s.request.prompt_ids) for s in seqs]
        packed = Packed.of(lens, self.device)
        # from page-locked memory, queued behind the decode step in flight (a pageable copy would wait for it)
        ids = to_device(torch.tensor([t for s in seqs for t in s.request.prompt_ids])[None], self.device)
        positions = packed.positions(self.device)[0]
        slots = to_device(torch.repeat_interleave(torch.tensor([s.slot for s in seqs]), torch.tensor(lens)), self.device)
        hidden, routes = prefill_packed(self.model, ids, packed, self.cache, slots, positions)
        if routes is not None and self.capture_experts:
            self.state.routes[slots, positions] = routes[0].to(self.state.routes.dtype)
        last = hidden[0, packed.cu_seqlens[1:].long() - 1]  # each prompt's last row
        return list(zip(seqs, last.unbind(0)))

    def _prefill_group(self, seqs: list[SlotSequence]) -> list[tuple[SlotSequence, torch.Tensor]]:
        lens = [len(s.request.prompt_ids) for s in seqs]
        t = max(lens)
        chunk = max(1, min(t, self.prefill_tokens // len(seqs)))
        ids = right_pad([s.request.prompt_ids for s in seqs]).to(self.device)
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

    def _decode(self, seqs: list[SlotSequence]) -> list[Completion]:
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

    def _completions(self, ending: list[tuple[SlotSequence, FinishReason]]) -> list[Completion]:
        """A step's finished sequences read back together: their log-probabilities (and routes) gathered on the
        device and copied to the host once, not one wait on the device per sequence (in the network, where the GPU
        is shared, each such wait took ~0.9 ms: session 42); hidden states stay on the device."""
        st = self.state
        plens = [len(s.request.prompt_ids) for s, _ in ending]
        ends = [p + len(s.tokens) for p, (s, _) in zip(plens, ending)]
        slots = torch.tensor([s.slot for s, _ in ending], device=self.device)
        width = max(ends)
        logp = st.logp[slots, :width].cpu()
        routes = st.routes[slots, : width - 1].cpu() if self.capture_experts else None
        return [Completion(
            request_id=s.request.request_id, prompt_ids=list(s.request.prompt_ids), token_ids=s.tokens,
            logprobs=logp[i, plen:end].tolist(), versions=s.versions, finish_reason=reason,
            hidden=st.hidden[s.slot, plen - 1 : end - 1].clone() if self.capture_hidden else None,
            routed_experts=routes[i, : end - 1].long() if routes is not None else None,
        ) for i, (plen, end, (s, reason)) in enumerate(zip(plens, ends, ending))]
