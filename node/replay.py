"""The node's side of verification: the torch model, seeded sampler and environments as a
`verification.Reference`, and the prover hook that turns engine completions into proofs.

Kept here (not in `verification/`) because `verification` may import only `protocol`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

import torch

from node.engine.fp8.model import fp8_mode_of
from node.engine.sampling import SamplingParams, sample, token_seeds, top_p_mask
from node.model.batching import GROUP_OVERHEAD_TOKENS, packed_groups, padded_groups, right_pad
from node.model.cache import KVCache
from node.model.packed import Packed, PackedKV, varlen_usable
from node.model.qwen3_moe import CausalLM
from node.model.routing import InvalidRoutes, RouteShape, decode_routes
from verification.claim import SamplingSpec
from verification.pooled import shape_of
from verification.reference import Reference, Replay


def packing(device: torch.device, dtype: torch.dtype, continued: bool = False) -> bool:
    """Whether a recomputation packs its sequences end to end (no padding; node/model/packed.py): on a GPU in bf16 or
    fp16, where attention over them is one variable-length flash kernel; PRIMERL_JUDGE_PACKED=0 pads them into
    rectangles as before session 29. The CPU pads (its attention over packed rows would be a loop). `continued`:
    mixed-version sequences, one forward per version's parts (`_PackedMixed`)."""
    return varlen_usable(device, dtype, continued) and os.environ.get("PRIMERL_JUDGE_PACKED", "1") != "0"


def route_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype that holds expert ids below `num_experts` (routes sent to a device as ids)."""
    return torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 2**15 else torch.int64


def sampling_params(spec: SamplingSpec) -> SamplingParams:
    return SamplingParams(temperature=spec.temperature, top_p=spec.top_p, max_new_tokens=spec.max_new_tokens,
                          seed=spec.seed, stop_token_ids=tuple(spec.stop_token_ids),
                          stop_strings=tuple(spec.stop_strings))


MixedItem = tuple[list[int], list[tuple[int, int, int]], int, "torch.Tensor | None"]
"""One mixed-version sequence: (tokens, its (version, start, end) segments, logits_from, replay)."""


def _mixed_result(state: dict, with_routes: bool, with_router_logits: bool) -> tuple:
    logits, hidden, routes, router = state["logits"], state["hidden"], state["routes"], state["router"]
    if not with_routes:
        return torch.cat(logits), torch.cat(hidden)
    out = (torch.cat(logits), torch.cat(hidden), None if routes[0] is None else torch.cat(routes))
    return out + ((None if router[0] is None else torch.cat(router)),) if with_router_logits else out


class TorchReference(Reference):
    """Recompute with our `CausalLM`. `policies` maps version -> (model, 32-byte manifest hash): one model
    per version, or one resident model that each lookup switches to that version in place (the
    validator's, node/roles/resident_policy.py); a model is used only right after its lookup."""

    def __init__(self, policies: dict[int, tuple[CausalLM, bytes]], eos_id: int, max_seq_len: int,
                 decode: Callable[[list[int]], str], tasks: Callable[[str, int], list[int]] | None = None,
                 reward: Callable[[str, int, list[int]], float] | None = None, batch_tokens: int | None = None):
        self.policies = policies
        any_model = policies[max(policies)][0]  # the newest: a resident model (node/roles/resident_policy.py) holds it
        self.config = any_model.config
        self.hidden_size = any_model.config.hidden_size
        self._route_shape = RouteShape.of(self.config)  # every version's: one architecture (per claim it cost ~3 us)
        self.vocab_size = any_model.config.vocab_size
        # an FP8-served model (node/engine/fp8/model.py) is judged by the thresholds of its FP8 mode on its base
        # dtype ("fp8-experts-bfloat16"); a plain one by its dtype's
        fp8, dtype = fp8_mode_of(any_model), str(next(any_model.parameters()).dtype).removeprefix("torch.")
        self.precision = f"fp8-{fp8}-{dtype}" if fp8 != "off" else dtype
        self.shape = shape_of(self.config)
        self.eos_id, self.max_seq_len = eos_id, max_seq_len
        self._decode, self._tasks, self._reward = decode, tasks, reward
        device = next(any_model.parameters()).device
        self.device, self.param_dtype = device, next(any_model.parameters()).dtype
        self.on_device = device.type == "cuda"
        """Outputs stay on the model's GPU and every check runs there (only verdict-sized data comes back);
        on the CPU they are host tensors anyway."""
        self.exact_float32 = self.on_device and dtype == "float32"
        """A float32 run judged on a GPU recomputes its float32 matmuls without TF32 (`exact_float32`),
        whatever the process set: TF32 rounds inputs to 10 mantissa bits, which the float32 tolerances
        (calibrated on exact CPU float32) do not cover. bf16 / FP8 runs are left as they are."""
        budget = logits_budget(device, self.vocab_size)
        # a prefill batch holds [tokens, vocab] logits three times over (model dtype, float32 copy, the
        # checks' log_softmax): bound them by the budget (CPU: 256 MiB, 65,536 tokens of the tiny model's
        # 88-token vocabulary, ~1,300 of SmolLM2's 49,152; GPU: a share of free memory, at most GPU_PREFILL_TOKENS)
        self.batch_tokens = batch_tokens or prefill_batch_tokens(budget, self.vocab_size, self.on_device)
        self.packed_tokens = forward_tokens(budget, self.vocab_size, device, self.param_dtype) if self.on_device else None
        """Tokens one packed prefill takes (`packing`): a whole group of claims the validator sizes by `logits_bytes`
        (float32 logits of every token), in one forward; its logits are only the judged rows', in the model's dtype.
        Padded, the group took 3 forwards on an H100 at the 30B shape (each forward's kernels are ~2,000 launches
        of the host's, ~60 us each for a Triton kernel)."""
        self.logits_bytes = budget if self.on_device else None
        """Completion logits (float32) one group of claims may hold at once on a GPU (None: the CPU's
        `verification.validator.PREFILL_LOGITS_BYTES`)."""

    def manifest_hash(self, version: int) -> bytes | None:
        hashes = getattr(self.policies, "hashes", None)  # a resident model's: asking must not switch its weights
        if hashes is not None:
            return hashes.get(version)
        p = self.policies.get(version)
        return None if p is None else p[1]

    def decode_routes(self, data: bytes, positions: int) -> torch.Tensor:
        shape = self._route_shape
        if shape is None:
            raise InvalidRoutes("routes claimed for a dense model")
        return decode_routes(data, positions, shape)

    @torch.inference_mode()
    def prefill(self, version: int, sequences: list[list[int]], with_routes: bool = False,
                with_router_logits: bool = False, logits_from: list[int] | None = None,
                replay: list[torch.Tensor] | None = None) -> list[tuple]:
        with exact_float32(self.exact_float32), judging_kernels(self.on_device):
            return self._prefill(version, sequences, with_routes, with_router_logits, logits_from, replay)

    def _prefill(self, version: int, sequences: list[list[int]], with_routes: bool, with_router_logits: bool,
                 logits_from: list[int] | None, replay: list[torch.Tensor] | None) -> list[tuple]:
        model = self.policies[version][0]
        device = next(model.parameters()).device
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(sequences)
        if packing(device, self.param_dtype) and all(sequences):
            for members in packed_groups([len(s) for s in sequences], self.packed_tokens or self.batch_tokens):
                self._prefill_packed(model, sequences, members, with_routes, with_router_logits, logits_from, replay,
                                     out)
            return out  # type: ignore[return-value]
        # batches of similar length, bounded in padded tokens (right padding; causal, so exact), grouped to pad
        # least (a long-tailed round's longest rows would pad the shorter ones beside them up to their length)
        for members in padded_groups([len(s) for s in sequences], self.batch_tokens, GROUP_OVERHEAD_TOKENS):
            ids = right_pad([sequences[i] for i in members])
            t = ids.shape[1]
            forced = None
            if replay is not None:  # right padding routes to experts 0..k-1: causal, so it touches no real row
                k = replay[members[0]].shape[-1]
                # in the narrowest integer type that holds the expert ids (the router widens each layer's slice on
                # the device): [B, T, layers, k] int64 was 35 MB of pageable copy a batch at the 30B shape
                forced = torch.arange(k, dtype=route_dtype(self.config.num_experts)).expand(
                    len(members), t, replay[members[0]].shape[1], k).clone()
                for row, i in enumerate(members):
                    forced[row, : len(sequences[i])] = replay[i]
                forced = forced.to(device)
            # the LM head only from the first position any member needs ([T, V] is most of the memory)
            base = min(logits_from[i] for i in members) if logits_from is not None else 0
            res = model(ids.to(device), routed_experts=forced, logits_at=base)
            # the batch's routes come back in one transfer; its router logits stay where the checks run
            # (verification.routing.check_routes_many: a GPU validator compares them on its GPU)
            routes_host = res.routed_experts.cpu() if with_routes and res.routed_experts is not None else None
            router_host = (_router_logits(res, len(members), t, host=not self.on_device)
                           if with_routes and with_router_logits else None)
            lens = [len(sequences[i]) for i in members]
            los = [logits_from[i] - base if logits_from is not None else 0 for i in members]
            ends = [max(lo, n - base) for n, lo in zip(lens, los)]
            # copies, not views: a view would keep the whole batch's [B, T, V] logits alive
            if self.on_device:  # every member's rows in one gather each, views of them (2 kernels, not 2 a member)
                # in the model's dtype: the replay reads them as float32 (`measure_rows`), exact, with no [N, V]
                # float32 copy beside them (twice the bytes of bf16 logits, written and read again)
                logits = _rows(res.logits, los, ends)
                hidden = _rows(res.hidden, [0] * len(lens), lens)
                rows, a, h = [], 0, 0
                for lo, end, n in zip(los, ends, lens):
                    rows.append((logits[a : a + end - lo], hidden[h : h + n]))
                    a, h = a + end - lo, h + n
            else:  # on the host one copy each (a fresh [sum, V] gather pays its first touch: slower at 49k words)
                rows = [(res.logits[row, lo:end].to(torch.float32, copy=True), res.hidden[row, :n].clone())
                        for row, (lo, end, n) in enumerate(zip(los, ends, lens))]
            for row, (i, n) in enumerate(zip(members, lens)):
                out[i] = rows[row]
                if with_routes:
                    out[i] += (None if routes_host is None else routes_host[row, :n],)
                    if with_router_logits:
                        out[i] += (None if router_host is None else router_host[row, :n],)
        return out  # type: ignore[return-value]

    def _prefill_packed(self, model: CausalLM, sequences: list[list[int]], members: list[int], with_routes: bool,
                        with_router_logits: bool, logits_from: list[int] | None, replay: list[torch.Tensor] | None,
                        out: list) -> None:
        """`members` end to end in one row (node/model/packed.py: no padded position in any projection or expert),
        the LM head applied to the rows the checks read only (each member's from its `logits_from`)."""
        device = self.device
        lens = [len(sequences[i]) for i in members]
        packed = Packed.of(lens, device)
        ids = torch.tensor([t for i in members for t in sequences[i]])[None].to(device, non_blocking=True)
        forced = None
        if replay is not None:
            forced = torch.cat([replay[i].to(route_dtype(self.config.num_experts)) for i in members])[None].to(device)
        res = model(ids, routed_experts=forced, logits_at=packed.tokens, packed=packed)
        los = [min(logits_from[i], n) if logits_from is not None else 0 for i, n in zip(members, lens)]
        for i, (logits, hidden, routes, router) in zip(members, _packed_rows(model, res, lens, los, with_routes,
                                                                             with_routes and with_router_logits)):
            out[i] = (logits, hidden, routes, router)[: 2 + with_routes + (with_routes and with_router_logits)]

    @torch.inference_mode()
    def prefill_mixed(self, sequence: list[int], segments: list[tuple[int, int, int]],
                      with_routes: bool = False, with_router_logits: bool = False, logits_from: int = 0,
                      replay: torch.Tensor | None = None, free_before: int = 0) -> tuple:
        with exact_float32(self.exact_float32), judging_kernels(self.on_device):
            return self._prefill_mixed(sequence, segments, with_routes, with_router_logits, logits_from, replay,
                                       free_before)

    @torch.inference_mode()
    def prefill_mixed_many(self, items: list[MixedItem], with_routes: bool = False,
                           with_router_logits: bool = False) -> list[tuple]:
        """`Reference.prefill_mixed_many`: every sequence whose versions rise along it, one segment per version
        (an engine's do: a swap only moves forward), is computed version by version, each version's segments of
        all of them while it is active, so a resident model (node/roles/resident_policy.py) switches once per
        version, not twice per sequence; and in batches (`_MixedBatch`: sequences of similar length, bounded in
        padded tokens as `prefill`'s are, each segment at its own positions over the KV its earlier segments
        wrote), one forward per version and batch, not one per segment. Any other sequence alone."""
        with exact_float32(self.exact_float32), judging_kernels(self.on_device):
            out: list[tuple | None] = [None] * len(items)
            rising = [i for i, it in enumerate(items) if all(a[0] < b[0] for a, b in zip(it[1], it[1][1:]))]
            for i in sorted(set(range(len(items))) - set(rising)):
                seq, segments, start, replay = items[i]
                out[i] = self._prefill_mixed(seq, segments, with_routes, with_router_logits, start, replay)
            batches: list[_MixedBatch | _PackedMixed] = []
            packs = packing(self.device, self.param_dtype, continued=True)
            for forced in (False, True):  # rows that replay routes and rows that route freely, apart
                kind = [i for i in rising if (items[i][3] is not None) == forced]
                lens = [len(items[i][0]) for i in kind]
                if packs:
                    groups = packed_groups(lens, self.packed_tokens or self.batch_tokens)
                else:
                    groups = padded_groups(lens, self.batch_tokens, GROUP_OVERHEAD_TOKENS)
                batches += [(_PackedMixed if packs else _MixedBatch)(self, [kind[j] for j in g], items) for g in groups]
            for version in sorted({v for i in rising for v, _, _ in items[i][1]}):
                model = self.policies[version][0]  # a resident model switches here, once per version
                for batch in batches:
                    batch.run(model, version, with_routes)
            for batch in batches:
                for i, state in batch.states.items():
                    out[i] = _mixed_result(state, with_routes, with_router_logits)
            return out  # type: ignore[return-value]

    def _prefill_mixed(self, sequence: list[int], segments: list[tuple[int, int, int]], with_routes: bool,
                       with_router_logits: bool, logits_from: int, replay: torch.Tensor | None,
                       free_before: int = 0) -> tuple:
        state = self._mixed_state(sequence)
        for version, start, end in segments:
            self._mixed_segment(state, version, start, end, logits_from, None if end <= free_before else replay)
        return _mixed_result(state, with_routes, with_router_logits)

    def _mixed_state(self, sequence: list[int]) -> dict:
        """One sequence's KV cache and the outputs its segments append to (no version looked up: with a
        resident model a lookup is a switch)."""
        cfg, device = self.config, self.device
        cache = KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, len(sequence), cfg.head_dim,
                        dtype=self.param_dtype, device=device)
        return {"cache": cache, "ids": torch.tensor([sequence], device=device), "device": device,
                "slots": torch.zeros(1, dtype=torch.long, device=device),
                "logits": [], "hidden": [], "routes": [], "router": []}

    def _mixed_segment(self, state: dict, version: int, start: int, end: int, logits_from: int,
                       replay: torch.Tensor | None) -> None:
        """Positions [start, end) of the sequence under `version`, attending to the KV its earlier segments wrote."""
        device = state["device"]
        forced = None if replay is None else replay[start:end][None].to(device)
        out = self.policies[version][0](state["ids"][:, start:end], torch.arange(start, end, device=device)[None],
                                        state["cache"], state["slots"], routed_experts=forced,
                                        logits_at=min(max(0, logits_from - start), end - start))
        state["logits"].append(out.logits[0].float() if self.on_device else out.logits[0].float().cpu())
        state["hidden"].append(out.hidden[0] if self.on_device else out.hidden[0].cpu())
        state["routes"].append(None if out.routed_experts is None else out.routed_experts[0].cpu())
        r = _router_logits(out, 1, end - start)
        state["router"].append(None if r is None else r[0])

    def replay_sampling(self, logits: torch.Tensor, spec: SamplingSpec, positions: list[int]) -> Replay:
        if logits.is_cuda:
            return replay_on_device(logits, spec, positions)
        params = sampling_params(spec)
        s = sample(logits, [params] * len(positions), positions)
        return Replay(s.tokens, s.logprobs, s.margins)

    def measure_tokens(self, logits: list[torch.Tensor], samplings: list[SamplingSpec], positions: list[list[int]],
                       claimed: list[list[int]]) -> list[tuple[torch.Tensor, Replay]]:
        """`Reference.measure_tokens` over all segments' rows at once (`measure_rows`): one code path on the
        CPU and the GPU, no host synchronisation per segment, one transfer of per-token figures back."""
        lens = [len(c) for c in claimed]
        rows = sum(lens)
        if rows == 0:
            empty = torch.zeros(0)
            return [(empty, Replay(empty.long(), empty, empty)) for _ in claimed]
        vocab = logits[0].shape[-1]
        chunk = max(64, (self.logits_bytes or CPU_LOGITS_BYTES) // (MEASURE_SCRATCH_FACTOR * 4 * vocab))
        temps = [t for sp, n in zip(samplings, lens) for t in [sp.temperature] * n]
        top_p = [p for sp, n in zip(samplings, lens) for p in [sp.top_p] * n]
        seeds = [s for sp, pos in zip(samplings, positions)
                 for s in (token_seeds(sp.seed, pos) if sp.temperature > 0 else [None] * len(pos))]
        lp, tok, margin = measure_rows(logits, [t for c in claimed for t in c], temps, top_p, seeds, chunk)
        out, k = [], 0
        for n in lens:
            out.append((lp[k : k + n], Replay(tok[k : k + n], lp[k : k + n], margin[k : k + n])))
            k += n
        return out

    def decode(self, ids: list[int]) -> str:
        return self._decode(ids)

    def prompt_ids(self, env: str, task_seed: int) -> list[int]:
        if self._tasks is None:
            raise KeyError("this reference has no environments")
        return self._tasks(env, task_seed)

    def reward(self, env: str, task_seed: int, completion_ids: list[int]) -> float:
        if self._reward is None:
            raise KeyError("this reference has no environments")
        return self._reward(env, task_seed, completion_ids)


@contextmanager
def judging_kernels(on_device: bool) -> Iterator[None]:
    """The recomputation's kernels on a GPU. Attention without cuDNN's kernel (flash, memory-efficient, or math where
    neither takes the shapes): cuDNN's cost 0.9 ms of host time a call (a graph per new shape; 171 ms of 64 claims'
    1.17 s on an H100 at the 30B shape), and 256 claims were judged in 3.5 s without it against 4.1 s, every verdict
    the same (session 27, `benchmarks.real_scale`'s `verify_s_no_cudnn_sdp`); PRIMERL_JUDGE_SDPA=cudnn keeps it (to
    measure). RMSNorm as the engine's one Triton kernel (`norm_kernels.rms_norm`, what a node's `CudaEngine` runs:
    the module's float32 path is seven kernels, ~10% of those 64 claims' kernel time; not measured apart yet) and the
    MoE combine and the q/k norm and rotation as the engine's kernels (`forward.fused_kernels`); PRIMERL_FUSED_KERNELS=0 keeps the modules' ops,
    as it does in the engine."""
    if not on_device:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from node.engine.forward import FUSED, fused_kernels
    from node.model.qwen3_moe import FUSED_NORM

    attention = (nullcontext() if os.environ.get("PRIMERL_JUDGE_SDPA") == "cudnn"
                 else sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]))
    token = None
    if FUSED and torch.cuda.is_available():
        from node.engine.norm_kernels import rms_norm

        token = FUSED_NORM.set(rms_norm)
    try:
        with attention, fused_kernels(FUSED and torch.cuda.is_available()):
            yield
    finally:
        if token is not None:
            FUSED_NORM.reset(token)


@contextmanager
def exact_float32(on: bool) -> Iterator[None]:
    """float32 matmuls (cuBLAS, cuDNN) in full float32 while it lasts, the process's settings restored after.
    The settings are process-wide: a float32 engine in the same process decoding meanwhile runs exact too."""
    if not on:
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


CPU_LOGITS_BYTES = 256 << 20
"""Logits a CPU validator holds at once (verification.validator.PREFILL_LOGITS_BYTES)."""
GPU_LOGITS_SHARE = 0.25
"""Share of the GPU's free memory (when the reference is built) a validator's logits may take: the
rest is the model's, the activations', and on a shared GPU the other roles'."""
GPU_PREFILL_TOKENS = 8192
"""...and at most the logits of this many tokens (held three times over, `prefill_batch_tokens`): an MoE
prefill of 8k tokens already gives each of 128 experts ~512 token rows at top-8, and a quarter of an H200
(34 GiB at Qwen3's 152k vocabulary: 18.8k tokens) left a GPU shared with a trainer and an inference node no
room to stage versions or keep the validator's deltas (the 5.2B network, session 14: 138.7 of 139.8 GiB
in use, deltas of 6.5-10.5 GB held on the host, a version held 8-12 s after its announcement)."""


def logits_budget(device: torch.device, vocab_size: int) -> int:
    """Bytes of logits one prefill group may hold on `device` (sized from free memory on a GPU)."""
    if device.type != "cuda":
        return CPU_LOGITS_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return logits_budget_of("cuda", free, vocab_size)


def logits_budget_of(device: str, free_bytes: int, vocab_size: int) -> int:
    """`logits_budget` on a `device` with `free_bytes` free (the memory plan's, before the model exists)."""
    if not device.startswith("cuda"):
        return CPU_LOGITS_BYTES
    return max(CPU_LOGITS_BYTES, min(int(GPU_LOGITS_SHARE * free_bytes), 12 * vocab_size * GPU_PREFILL_TOKENS))


def prefill_batch_tokens(budget: int, vocab_size: int, on_device: bool) -> int:
    """Padded tokens one recomputation prefill takes: its [tokens, vocab] logits held three times over
    (model dtype, float32 copy, the checks' log_softmax) within `budget`."""
    return max(256, min(65_536 if not on_device else 1 << 20, budget // (12 * vocab_size)))


def forward_tokens(budget: int, vocab_size: int, device: torch.device, dtype: torch.dtype) -> int:
    """Tokens one recomputation forward takes on `device`: packed (`packing`), a whole group of claims the validator
    sizes by float32 logits of every token (`budget // (4 x vocab)`), its logits the judged rows' only, in the model's
    dtype; else the padded batch (`prefill_batch_tokens`). What the memory plan counts activations for."""
    padded = prefill_batch_tokens(budget, vocab_size, device.type == "cuda")
    return max(padded, budget // (4 * vocab_size)) if packing(device, dtype) else padded


MEASURE_SCRATCH_FACTOR = 32
"""`measure_rows` takes row chunks whose float32 [rows, V] logits are 1/32 of the reference's logits budget:
the seeded noise of a chunk holds several int64 / float64 [rows, V] temporaries (8 bytes a word, a few alive
at once) beside the log-softmax and the scores, on top of the logits the budget already holds."""


def measure_rows(parts: list[torch.Tensor], claimed: list[int], temps: list[float], top_p: list[float],
                 seeds: list[int | None], chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Over the rows of `parts` (logits [n_i, V] on one device, concatenated in order): the claimed token's
    log_softmax(logits / T) and the seeded rule's choice and margin (`sampling.sample`'s rule: top-p nucleus
    where top_p < 1, Gumbel noise of token seed `seeds[r]` where T > 0: on a GPU `gumbel_torch`, on the host
    `sampling.gumbel_noise`, the same bits). In chunks of `chunk_rows` rows; returns host tensors
    (float32 [N], long [N], float32 [N]) after one transfer."""
    from node.engine.device_sampling import gumbel_torch
    from node.engine.sampling import gumbel_noise

    device, n = parts[0].device, len(claimed)
    temps_t, top_p_t = torch.tensor(temps, dtype=torch.float32), torch.tensor(top_p, dtype=torch.float32)
    # every row's inputs in one transfer of floats (divisor, top-p, temperature) and one of integers (claimed
    # token, token seed), not a few a chunk: a copy from pageable host memory waits for the work queued on the device
    drawn_t = torch.tensor([s is not None for s in seeds], dtype=torch.bool)
    floats = torch.stack([torch.where(temps_t > 0, temps_t, torch.ones_like(temps_t)), top_p_t,
                          torch.where(drawn_t, temps_t, torch.zeros_like(temps_t))]).to(device)
    ints = torch.tensor([claimed, [0 if s is None else s for s in seeds]], dtype=torch.long).to(device)
    divisor, claimed_t = floats[0], ints[0]
    fused = fused_replay(device) and bool(((temps_t > 0) == drawn_t).all())
    figures = torch.empty(3, n, dtype=torch.float32, device=device)  # claimed logprob, replayed token, margin
    for a, x in _row_chunks(parts, chunk_rows):
        b = a + x.shape[0]
        if fused:  # two Triton passes over the chunk's logits; the nucleus (if any row has one) from torch
            from node.engine.sampling_kernels import replay_triton

            keep = None
            nucleus = (top_p_t[a:b] < 1).nonzero().squeeze(-1)
            if len(nucleus):
                keep = torch.ones(x.shape, dtype=torch.bool, device=device)
                rows = nucleus.to(device)
                logp = torch.log_softmax(x[rows].float() / divisor[a:b][rows, None], dim=-1)
                keep[rows] = top_p_mask(logp, floats[1, a:b][rows])
            lp, tok, margin = replay_triton(x, floats[2, a:b], ints[1, a:b], claimed_t[a:b], keep)
            figures[0, a:b], figures[1, a:b], figures[2, a:b] = lp, tok.float(), margin
            continue
        logp = torch.log_softmax(x.float() / divisor[a:b, None], dim=-1)
        figures[0, a:b] = logp.gather(-1, claimed_t[a:b, None]).squeeze(-1)
        scores = logp
        nucleus = (top_p_t[a:b] < 1).nonzero().squeeze(-1)
        if len(nucleus) == b - a:  # every row (a run's spec sets one top-p): no rows gathered, the same values
            scores = logp.masked_fill(~top_p_mask(logp, floats[1, a:b]), float("-inf"))
        elif len(nucleus):  # only those rows: a row at top_p 1 would fall back to a full sort of the vocabulary
            rows = nucleus.to(device)
            scores = scores.clone()
            scores[rows] = logp[rows].masked_fill(~top_p_mask(logp[rows], top_p_t[a:b][nucleus].to(device)),
                                                  float("-inf"))
        drawn = [r for r in range(a, b) if seeds[r] is not None]
        if len(drawn) == b - a:  # every row sampled: the noise added to all, as index_add adds it row by row
            if device.type == "cuda":
                noise = gumbel_torch(ints[1, a:b], x.shape[-1])
            else:
                noise = gumbel_noise(seeds[a:b], x.shape[-1])
            scores = scores + noise
        elif drawn:
            local = torch.tensor([r - a for r in drawn], dtype=torch.long).to(device)
            if device.type == "cuda":
                noise = gumbel_torch(torch.tensor([seeds[r] for r in drawn], dtype=torch.int64).to(device), x.shape[-1])
            else:
                noise = gumbel_noise([seeds[r] for r in drawn], x.shape[-1])
            scores = scores.index_add(0, local, noise.to(device))
        top2 = scores.topk(2, dim=-1)
        figures[1, a:b] = top2.indices[:, 0].float()  # exact: token ids < 2**24
        figures[2, a:b] = top2.values[:, 0] - top2.values[:, 1]
    host = figures.cpu()
    return host[0], host[1].long(), host[2]


def fused_replay(device: torch.device) -> bool:
    """Whether `measure_rows` replays the seeded rule with the Triton passes (`sampling_kernels.replay_triton`:
    no [rows, V] noise or score temporaries) rather than torch ops: on a GPU (unless PRIMERL_REPLAY=torch, kept to
    measure against), and on the CPU only in Triton's interpreter with PRIMERL_REPLAY=triton (tests)."""
    choice = os.environ.get("PRIMERL_REPLAY", "")
    if choice == "torch":
        return False
    if device.type == "cuda":
        return True
    return choice == "triton" and os.environ.get("TRITON_INTERPRET") == "1"


def _row_chunks(parts: list[torch.Tensor], chunk_rows: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, rows) of the concatenation of `parts`, at most `chunk_rows` rows at a time."""
    pending, size, start = [], 0, 0
    for x in parts:
        lo = 0
        while lo < x.shape[0]:
            take = min(x.shape[0] - lo, chunk_rows - size)
            pending.append(x[lo : lo + take])
            size, lo = size + take, lo + take
            if size == chunk_rows:
                yield start, pending[0] if len(pending) == 1 else torch.cat(pending)
                start, pending, size = start + size, [], 0
    if pending:
        yield start, pending[0] if len(pending) == 1 else torch.cat(pending)


def replay_on_device(logits: torch.Tensor, spec: SamplingSpec, positions: list[int]) -> Replay:
    """`sampling.sample`'s rule where the logits are: the same temperature, top-p nucleus and seeded
    Gumbel noise (`device_sampling.gumbel_torch`, bit-identical to the host's splitmix64 draw), so a
    GPU validator reaches the CPU's decisions without copying [N, V] logits to the host."""
    from node.engine.device_sampling import gumbel_torch

    device = logits.device
    scaled = logits.float() / (spec.temperature if spec.temperature > 0 else 1.0)
    logp = torch.log_softmax(scaled, dim=-1)
    scores = logp
    if spec.top_p < 1:
        top_p = torch.full((logp.shape[0],), spec.top_p, dtype=torch.float32, device=device)
        scores = scores.masked_fill(~top_p_mask(logp, top_p), float("-inf"))
    if spec.temperature > 0:
        seeds = torch.tensor(token_seeds(spec.seed, positions), dtype=torch.int64, device=device)
        scores = scores + gumbel_torch(seeds, logits.shape[-1])
    top2 = scores.topk(2, dim=-1)
    tokens = top2.indices[:, 0]
    return Replay(tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), top2.values[:, 0] - top2.values[:, 1])


class _MixedBatch:
    """Sequences of several versions recomputed together (`TorchReference.prefill_mixed_many`): one KV cache row
    each, and per version one forward of every member's segment of that version, right-padded, each row at its
    own positions (the attention masks keys by position, so a row sees exactly the KV its earlier segments wrote;
    a padded position writes past its row's end, where the next segment writes again before anything reads it).
    The cache has room for every segment padded to its version's longest here, and no more."""

    def __init__(self, ref: TorchReference, members: list[int], items: list):
        cfg = ref.config
        self.ref, self.items, self.members = ref, items, members
        widest: dict[int, int] = {}  # version -> its longest segment here: every row of its forward is padded to it
        for i in members:
            for v, a, b in items[i][1]:
                widest[v] = max(widest.get(v, 0), b - a)
        room = max(a + widest[v] for i in members for v, a, _ in items[i][1])  # the last position a forward writes
        self.cache = KVCache(cfg.num_hidden_layers, len(members), cfg.num_key_value_heads, room, cfg.head_dim,
                             dtype=ref.param_dtype, device=ref.device)
        self.states = {i: {"logits": [], "hidden": [], "routes": [], "router": []} for i in members}

    def run(self, model: CausalLM, version: int, with_routes: bool) -> None:
        rows = [(row, i, a, b) for row, i in enumerate(self.members) for v, a, b in self.items[i][1] if v == version]
        if not rows:
            return
        device, t = self.ref.device, max(b - a for _, _, a, b in rows)
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        positions = torch.empty(len(rows), t, dtype=torch.long)
        firsts = []  # each row's first position whose logits are kept (`_mixed_segment`'s logits_at)
        forced = None
        for r, (_, i, a, b) in enumerate(rows):
            seq, _, start, replay = self.items[i]
            ids[r, : b - a] = torch.tensor(seq[a:b])
            positions[r] = torch.arange(a, a + t)
            firsts.append(min(max(0, start - a), b - a))
            if replay is not None:  # padded positions route to experts 0..k-1 (they touch no real row)
                if forced is None:
                    k = replay.shape[-1]
                    forced = torch.arange(k, dtype=route_dtype(self.ref.config.num_experts)).expand(
                        len(rows), t, replay.shape[1], k).clone()
                forced[r, : b - a] = replay[a:b]
        base = min(firsts)
        slots = torch.tensor([row for row, _, _, _ in rows], device=device)
        out = model(ids.to(device), positions.to(device), self.cache, slots,
                    routed_experts=None if forced is None else forced.to(device), logits_at=base)
        router = _router_logits(out, len(rows), t) if with_routes else None
        routes = out.routed_experts.cpu() if with_routes and out.routed_experts is not None else None
        on_device = self.ref.on_device
        for r, (_, i, a, b) in enumerate(rows):
            n, state = b - a, self.states[i]
            logits = out.logits[r, firsts[r] - base : n - base].float()
            state["logits"].append(logits if on_device else logits.cpu())
            state["hidden"].append(out.hidden[r, :n] if on_device else out.hidden[r, :n].cpu())
            state["routes"].append(None if routes is None else routes[r, :n])
            state["router"].append(None if router is None else router[r, :n])


class _PackedMixed:
    """`_MixedBatch` packed (a GPU's way, `packing`): every member's tokens end to end in a `PackedKV`, and per
    version one forward of every member's segment of that version, end to end at their own positions, each
    attending to the keys its earlier segments wrote (node/model/packed.py). No padded row in any projection
    or expert, the LM head on the judged rows only; the same outputs, in the model's dtype."""

    def __init__(self, ref: TorchReference, members: list[int], items: list):
        cfg = ref.config
        self.ref, self.items, self.members = ref, items, members
        self.kv = PackedKV(cfg.num_hidden_layers, [len(items[i][0]) for i in members], cfg.num_key_value_heads,
                           cfg.head_dim, ref.param_dtype, ref.device)
        self.states = {i: {"logits": [], "hidden": [], "routes": [], "router": []} for i in members}

    def run(self, model: CausalLM, version: int, with_routes: bool) -> None:
        rows = [(j, i, a, b) for j, i in enumerate(self.members) for v, a, b in self.items[i][1] if v == version]
        if not rows:
            return
        device = self.ref.device
        packed = self.kv.part([(j, a, b) for j, _, a, b in rows])
        ids = torch.tensor([t for _, i, a, b in rows for t in self.items[i][0][a:b]])[None].to(device,
                                                                                            non_blocking=True)
        forced = None
        if self.items[rows[0][1]][3] is not None:  # every member replays routes, or none (`prefill_mixed_many`)
            dt = route_dtype(self.ref.config.num_experts)
            forced = torch.cat([self.items[i][3][a:b].to(dt) for _, i, a, b in rows])[None].to(device)
        res = model(ids, routed_experts=forced, logits_at=packed.tokens, packed=packed)
        firsts = [min(max(0, self.items[i][2] - a), b - a) for _, i, a, b in rows]  # each row's first judged position
        for (_, i, _, _), parts in zip(rows, _packed_rows(model, res, list(packed.lengths), firsts, with_routes,
                                                           with_routes)):
            for key, part in zip(("logits", "hidden", "routes", "router"), parts):
                self.states[i][key].append(part)


def _packed_rows(model: CausalLM, res, lens: list[int], firsts: list[int], with_routes: bool, with_router: bool
                 ) -> list[tuple]:
    """Each sequence's rows of a packed forward `res` (run with `logits_at=packed.tokens`: no LM head yet), in order:
    (logits from its `firsts` position on, in the model's dtype: the LM head on those rows only, one product;
    hidden states; routes on the host and router logits where the model's device is, None unless asked)."""
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    hidden = res.hidden[0]
    keep = torch.cat([torch.arange(s + f, e) for s, e, f in zip(starts, starts[1:], firsts)])
    logits = model.lm_head(hidden.index_select(0, keep.to(hidden.device)))  # [kept rows, V]
    routes = res.routed_experts[0].cpu() if with_routes and res.routed_experts is not None else None
    router = _router_logits(res, 1, starts[-1], host=False) if with_router else None
    out, c = [], 0
    for s, e, f in zip(starts, starts[1:], firsts):
        out.append((logits[c : c + e - s - f], hidden[s:e], None if routes is None else routes[s:e],
                    None if router is None else router[0, s:e]))
        c += e - s - f
    return out


def _rows(x: torch.Tensor, starts: list[int], ends: list[int]) -> torch.Tensor:
    """Rows [starts[b], ends[b]) of each batch row b of `x` [B, T, ...], concatenated in order: one gather."""
    b, t = x.shape[:2]
    lens = torch.tensor([e - s for s, e in zip(starts, ends)])
    first = torch.tensor([row * t + s for row, s in enumerate(starts)])
    # flat index of every row kept: its batch row's first kept index, plus its place among that row's kept ones
    offsets = torch.repeat_interleave(first - (torch.cumsum(lens, 0) - lens), lens)
    flat = offsets + torch.arange(int(lens.sum()))
    return x.reshape(b * t, *x.shape[2:]).index_select(0, flat.to(x.device))


def _router_logits(res, b: int, t: int, host: bool = True) -> torch.Tensor | None:
    """[b, t, moe_layers, E] float32 router logits of a batched forward, on the host unless `host` is False
    (None: dense model); the routing check uses them to tell a near-tie between experts from a wrong route."""
    if not res.router_logits:
        return None
    out = torch.stack([r.view(b, t, -1) for r in res.router_logits], dim=2).float()
    return out.cpu() if host else out


def env_oracle(tokenizer) -> tuple[Callable[[str, int], list[int]], Callable[[str, int, list[int]], float]]:
    """(prompt_ids, reward) callables over the built-in environments, as the rollout driver uses them. A
    validator asks both of every claim: the task a seed makes, and its prompt's tokens, are made once (the last
    4,096 kept), not once for each claim of a work unit (one task, `group` rollouts of it)."""
    from functools import lru_cache

    from node.envs import get_env

    @lru_cache(maxsize=4096)
    def task(env: str, seed: int):
        return get_env(env).sample_task(seed)

    @lru_cache(maxsize=4096)
    def prompt(env: str, seed: int) -> tuple[int, ...]:  # tokenized once for the claims of a work unit, not each
        return tuple(task(env, seed).prompt_ids(tokenizer))

    def prompt_ids(env: str, seed: int) -> list[int]:
        return list(prompt(env, seed))

    def reward(env: str, seed: int, completion_ids: list[int]) -> float:
        return float(get_env(env).reward(task(env, seed), tokenizer.decode(completion_ids)))

    return prompt_ids, reward
