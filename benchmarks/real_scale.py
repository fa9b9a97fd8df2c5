"""A 30B-class MoE on one GPU, served and judged by the roles' code: the full Qwen3-30B-A3B shape (48 layers,
128 experts top-8, Qwen3's 151,936-token vocabulary: 30.5B parameters), random weights written as a
block-scaled FP8 checkpoint (the Hugging Face / DeepSeek layout Qwen3 publishes), needs CUDA:

    python -m benchmarks.real_scale --dir /tmp/q30 --write [--fp8 all] [--tokenizer-from DIR]

1. `--write`: the checkpoint drawn and quantised on the GPU, written shard by shard
   (`benchmarks.random_checkpoint.write_random_shards`; the process never holds more than one shard).
2. Launch, timed from this process's start to the first sampled token, the steps `join --role inference
   --engine builtin-cuda` takes before its first lease: the checkpoint checked from its headers
   (`check_checkpoint`), the memory plan (`node.roles.memory.role_plan`), the model made on the meta device
   with its FP8 modules and filled tensor by tensor from the shards straight into them on the GPU
   (`load_model` with `apply_fp8_mode`: version 0 from the member's own copy), KV slots from free memory and
   every batch bucket's CUDA graph captured (`CudaEngine.from_setup`), one request of one token. What this
   leaves out of the role's start: joining the coordinator and checking the signed manifest of version 0.
3. Decode tok/s at batch 256 (`benchmarks.gpu_engine.fixed_batch`), the same batch with each of `VARIANTS` (the
   FP8 kernels' other choices, graphs captured again) and where a step's GPU time goes
   (`gpu_engine.decode_profile`: top kernels), and the RL-shaped workload
   (`gpu_engine.rl_workload`: 512 requests, log-normal lengths, completions up to 1,024 tokens, proofs).
4. The validator on the same GPU: its own copy loaded the same way, `TorchReference` + `verify_claims` (the
   validator role's call) over the RL rollouts, each claim its own submission; `verify_over_generate` is its
   completion tok/s over the engine's; 64 claims judged again under the profiler (`verify_profile`: wall
   seconds, the kernels' GPU seconds, the top kernels). Then, untimed, the same claims in submissions of 8 judged together, as
   the role meets a work unit (`verify_units_rejected`: pooled evidence, per-claim bounds as well).
5. A new version reaching the serving engine the way the inference role hands it one (`fetch_policy` ->
   `served(...)` -> `engine.load_weights` on the role's fetch thread, the swap between two decode steps):
   the checkpoint's own tensors in their served form (e4m3 bytes and block scales as stored, the layout an
   FP8 run publishes after version 0) as version 1, read through copy-on-write mappings of its files as a
   fetched version's payload is (`checkpoint_tensors`): `version_apply` times the check and staging on the
   device (`load_weights_s`; the engine's own `stage_s`, `staged_on_device`), the swap (`apply_s`) and the
   first token after it. That is the engine's part of a new version at this size; the fetch before it is not
   timed (no store here: the host's 64 GB disk holds the checkpoint and not one more version). The validator
   holds the same version 1 beside its judging (`ResidentPolicies.add`): `validator_hold_s`.
   5b. A sparse delta of version 1 (`apply_delta`): 0.25% of the experts' e4m3 bytes moved, as a fetch that
   decoded a delta against the version the engine serves hands it over (the changed bytes beside the version),
   written into the served tensors alone (`delta_apply`, `delta_apply_s`: the issue's figure for the engine's
   part), then put back (`restored_exact`). The delta's fetch and decode are not timed here.
Host memory: peak private memory (RssAnon, sampled every 50 ms: what the process holds beyond the page
cache the shards are read through) and peak RSS. GPU memory: the plan against `max_memory_allocated`.
Writes `real_scale.json` under $OUT (or benchmarks/results) after every stage, so a cut run keeps what
it measured; the last line printed is the JSON.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import torch

T_START = time.perf_counter()  # the launch clock starts with the process (imports included)

from benchmarks.fp8_common import log, machine_facts, write_result  # noqa: E402
from benchmarks.gpu_engine import (_requests, _sync, decode_profile, fixed_batch, profiled, rl_requests,  # noqa: E402
                                   rl_workload)

GIB = 1 << 30
UNIT = 8
"""Claims of one submission in the pooled pass (a work unit's group size in the role)."""


class MemorySampler:
    """Peak RssAnon and VmHWM of this process, read from /proc every `every` seconds on a thread."""

    def __init__(self, every: float = 0.05):
        self.peak_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    @staticmethod
    def status() -> dict[str, int]:
        out = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
        return out

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            self.peak_anon = max(self.peak_anon, self.status().get("RssAnon", 0))

    def figures(self) -> dict:
        s = self.status()
        self.peak_anon = max(self.peak_anon, s.get("RssAnon", 0))
        return {"host_private_peak_gib": self.peak_anon / GIB, "host_rss_peak_gib": s.get("VmHWM", 0) / GIB}


def _allocated(peak: bool = False) -> int:
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()


def run_spec(directory: Path, fp8: str, max_seq_len: int):
    from protocol.identity import NodeKey
    from protocol.messages import RunSpec
    from protocol.model_spec import ModelSpec

    return RunSpec(run_id="real-scale", coordinator=NodeKey.generate().peer_id,
                   model=ModelSpec(source=str(directory), dtype="bfloat16", fp8=fp8, max_seq_len=max_seq_len))


def load_served(spec, device: str):
    """The run's model on `device` as an FP8-serving member loads its own copy: FP8 modules swapped in on the
    meta model, then filled from the shards tensor by tensor."""
    from node.engine.fp8.model import apply_fp8_mode
    from node.model.spec import load_model

    return load_model(spec.model, device, prepare=lambda m: apply_fp8_mode(m, spec.model.fp8))


def launch(spec, device: str, share: float, result: dict):
    """The inference role's start (module docstring, 2): the engine serving version 0, timed by stage."""
    from node.engine.registry import EngineSetup, build
    from node.roles.common import check_checkpoint, model_config
    from node.roles.memory import role_plan
    from node.engine.memory_plan import host_or_gpu_free

    stages = {}
    t = time.perf_counter()
    check_checkpoint(spec)
    stages["check_checkpoint_s"] = time.perf_counter() - t
    plan = role_plan(spec, "inference", device, host_or_gpu_free(device), engine="builtin-cuda", fp8=spec.model.fp8)
    log(plan.describe())
    plan.check()
    result["gpu_memory_plan_gib"] = plan.total / GIB
    result["gpu_memory_plan"] = plan.describe()
    t = time.perf_counter()
    loaded = load_served(spec, device)
    _sync()
    stages["load_s"] = time.perf_counter() - t
    tok = loaded.tokenizer
    result["weights_gib_on_gpu"] = _allocated() / GIB
    cfg = model_config(spec)
    setup = EngineSetup(model=lambda: loaded.model, hf_config=cfg.to_hf_dict(), max_batch=512,
                        max_seq_len=spec.model.max_seq_len, eos_id=tok.eos_id, encode=tok.encode, decode=tok.decode,
                        bos_id=tok.bos_id, capture_experts=True, workdir=Path("/tmp/real-scale"), salt=spec.run_id,
                        device=device, fp8=spec.model.fp8, gpu_memory_share=share)
    t = time.perf_counter()
    engine = build("builtin-cuda", setup)
    stages["engine_build_s"] = time.perf_counter() - t  # KV plan + every bucket's graph
    engine.version = 0  # the loaded checkpoint is version 0 (a role gets it through load_weights)
    t = time.perf_counter()
    engine.generate(_requests(cfg, 1, [16], [1], seed=1))
    stages["first_token_s"] = time.perf_counter() - t
    result["launch_to_first_token_s"] = time.perf_counter() - T_START
    result["launch_stages_s"] = stages
    result["kv_slots"] = engine.max_batch
    log(f"first token {result['launch_to_first_token_s']:.1f}s after the process started: {stages}")
    return engine, cfg, tok


SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F16": torch.float16,
                      "F32": torch.float32, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files as stored (FP8 scales included), each a view over a
    copy-on-write mapping of its file, as a fetched version's tensors are views over its payload
    (`shardcast.fetch.PayloadTensors`): nothing is read until a consumer copies a tensor."""
    import numpy as np

    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        data = np.memmap(path, dtype=np.uint8, mode="c")[8 + n:]
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            lo, hi = entry["data_offsets"]
            out[name] = torch.from_numpy(data[lo:hi]).view(SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])
    return out


def as_published(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors as an FP8 run's trainer publishes a version (`node.rl.parallel.publish.hf_pieces`):
    an expert's gate and up go in e4m3 only where the gate's rows end on a 128-row block edge (they are one
    stacked tensor where served), else both in `dtype`. Qwen3-30B-A3B's 768 rows do: nothing changes there."""
    from node.model.quantization import SCALE_SUFFIX, dequantize
    from node.model.served_form import served_fp8

    out = dict(tensors)
    for name, t in tensors.items():
        if name.endswith(".gate_proj.weight") and ".mlp.experts." in name and f"{name}{SCALE_SUFFIX}" in tensors \
                and not served_fp8(tuple(t.shape), stacked_with_next=True):
            for piece in (name, name.replace(".gate_proj.", ".up_proj.")):
                out[piece] = dequantize(out.pop(piece), out.pop(f"{piece}{SCALE_SUFFIX}"), dtype)
    return out


def version1(spec):  # noqa: ANN001, ANN201
    """Stage 5's version 1 as a consumer reads a fetched one (`served`): the checkpoint's tensors as published."""
    from node.model.served_form import served
    from node.model.spec import DTYPES

    dtype = DTYPES[spec.model.dtype]
    return served(as_published(checkpoint_tensors(Path(spec.model.source)), dtype), dtype)


def fingerprint(model) -> dict[str, tuple[int, int]]:  # noqa: ANN001
    """Every served tensor's bytes reduced on its device to two exact integers (their sum and a position-weighted
    sum, as int64 words): equal fingerprints mean equal bytes but for a 2**-64 chance, whatever the GPU's order of
    summation; nothing the size of the model is copied."""
    out: dict[str, tuple[int, int]] = {}
    named = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    for name, t in named.items():
        words = t.detach().reshape(-1).view(torch.uint8)
        words = torch.nn.functional.pad(words, (0, -words.numel() % 4)).view(torch.int32)
        total = weighted = 0
        for at in range(0, words.numel(), 1 << 24):  # 64 MiB of words at a time
            w = words[at : at + (1 << 24)].to(torch.int64)
            total += int(w.sum())
            weighted += int((w * torch.arange(at + 1, at + 1 + w.numel(), device=w.device)).sum())
        out[name] = (total, weighted)
    return out


def apply_version(engine, cfg, spec, result: dict) -> None:  # noqa: ANN001
    """Stage 5 of the module docstring: the checkpoint's tensors handed to the serving engine as version 1. What
    must hold: every served byte as before (`weights_unchanged`, from `fingerprint`). The seeded probe's tokens are
    reported beside it, with whether the engine gives the same tokens twice on the same weights at all
    (`repeatable`: until session 25 the MoE combine added in bf16 with atomics on a GPU, where a sampled token could
    flip; node/model/moe.py)."""
    swaps: list[dict] = []
    engine.on_swap.append(lambda version, row: swaps.append(row))
    probe = _requests(cfg, 4, [16] * 4, [16] * 4, seed=3)  # seeded sampling: the same weights give the same tokens
    before = engine.generate(probe)
    repeatable = [a.token_ids for a in engine.generate(probe)] == [b.token_ids for b in before]
    served_before = fingerprint(engine.model)
    state = version1(spec)
    t = time.perf_counter()
    engine.load_weights(state, 1)  # checked and (where the GPU has room for a second copy) staged on the device
    staged = time.perf_counter() - t
    t = time.perf_counter()
    engine.generate(_requests(cfg, 1, [16], [1], seed=2))  # the swap lands before this step's forward
    first = time.perf_counter() - t
    if engine.version != 1 or not swaps:
        raise RuntimeError(f"version 1 was not applied (engine at version {engine.version})")
    served_after = fingerprint(engine.model)
    after = engine.generate(probe)  # version 1 holds the checkpoint's own bytes: nothing served may have moved
    row = swaps[-1]
    result["version_apply"] = {"load_weights_s": staged, "first_token_after_s": first, "bytes": row.get("bytes"),
                               "stage_s": row.get("stage_s"), "apply_s": row.get("apply_s"),
                               "staged_on_device": row.get("staged_on_device"),
                               "weights_unchanged": served_after == served_before,
                               "tensors_changed": sorted(n for n in served_before
                                                         if served_after.get(n) != served_before[n])[:20],
                               "repeatable": repeatable,
                               "same_tokens": [a.token_ids for a in after] == [b.token_ids for b in before],
                               "logprob_diff_max": max(abs(x - y) for a, b in zip(after, before)
                                                       for x, y in zip(a.logprobs, b.logprobs))}
    result["version_apply_s"] = staged + first
    log(f"version 1 into the engine: {result['version_apply']}")


DELTA_SHARE = 0.0025
"""Share of the experts' e4m3 bytes a delta moves in `apply_delta`: what one RL step changed of SmolLM2's served
form at lr 1e-6 (0.25%, `benchmarks/results/shardcast_delta-real-served-cpu-2core.json`)."""


def changed_bytes(state, parent: int, share: float, seed: int, back=None):  # noqa: ANN001, ANN201
    """A delta of `state` (version 1 as `version1` gives it) as a fetch that decoded it against its parent finds it
    (`shardcast.changes.ChangedBytes` over the payload's layout): `share` of every expert weight's e4m3 bytes moved by
    one bit (none made a NaN), at random positions; with `back` (such a delta), the same positions put back."""
    import numpy as np

    from shardcast.codec import layout
    from shardcast.changes import ChangedBytes

    published = state.tensors
    tensors, _ = layout(published)
    if back is not None:
        old = back.values ^ np.uint8(1)  # the delta's values hold the moved bit: flip it back
        return ChangedBytes(parent, tensors, back.positions, old)
    rng = np.random.default_rng(seed)
    pos, val = [], []
    for e in tensors:
        if ".mlp.experts." not in e.name or e.dtype != "float8_e4m3fn":
            continue
        k = max(1, int(e.nbytes * share))
        at = np.unique(rng.integers(0, e.nbytes, size=k))
        now = published[e.name].reshape(-1).view(torch.uint8).numpy()[at]
        moved = now ^ np.uint8(1)
        ok = (moved & 0x7F) != 0x7F  # e4m3's NaN
        pos.append(at[ok] + e.offset)
        val.append(moved[ok])
    order = np.argsort(np.concatenate(pos), kind="stable")
    return ChangedBytes(parent, tensors, np.concatenate(pos)[order], np.concatenate(val)[order])


class WithChanges(dict):
    """A version's tensors and `changes`, the bytes a delta changed in its parent, as a fetch hands a decoded delta over
    (`shardcast.fetch.PayloadTensors` carries them beside its payload's views; here the checkpoint's tensors)."""

    def __init__(self, tensors, changes) -> None:  # noqa: ANN001
        super().__init__(tensors)
        self.changes = changes


def apply_delta(engine, cfg, spec, result: dict) -> None:  # noqa: ANN001
    """Stage 5b: a sparse delta of the version the engine serves (version 1, stage 5), handed over as the inference
    role hands a fetched one (`load_weights` of the version with its `changes`, the swap between two decode
    steps): `DELTA_SHARE` of the experts' e4m3 bytes moved (`changed_bytes`), written alone (`SparseWrites`). Then
    the same positions put back as version 3: the served bytes must equal version 1's again (`restored_exact`,
    from `fingerprint`), which shows every write went where the payload's bytes lie. Not timed here: the fetch
    and decode before `load_weights` (docs/scale.md)."""
    from node.model.served_form import ServedForm

    swaps: list[dict] = []
    engine.on_swap.append(lambda version, row: swaps.append(row))
    state = version1(spec)
    served_v1 = fingerprint(engine.model)
    out = {}
    delta = None
    for version, parent in ((2, 1), (3, 2)):
        t = time.perf_counter()
        delta = changed_bytes(state, parent, DELTA_SHARE, seed=version, back=delta if version == 3 else None)
        made = time.perf_counter() - t
        moved = ServedForm(WithChanges(state.tensors, delta), state.dtype)
        t = time.perf_counter()
        engine.load_weights(moved, version)
        staged = time.perf_counter() - t
        t = time.perf_counter()
        engine.generate(_requests(cfg, 1, [16], [1], seed=2))  # the writes land before this step's forward
        first = time.perf_counter() - t
        row = swaps[-1]
        if engine.version != version:
            raise RuntimeError(f"version {version} was not applied (engine at version {engine.version})")
        out[f"v{version}"] = {"changed_bytes": int(len(delta.positions)), "made_s": made, "load_weights_s": staged,
                              "apply_s": row.get("apply_s"), "first_token_after_s": first,
                              "sparse_bytes": row.get("sparse_bytes"),
                              "served_changed": fingerprint(engine.model) != served_v1}
    out["restored_exact"] = fingerprint(engine.model) == served_v1
    out["share"] = DELTA_SHARE
    result["delta_apply"] = out
    result["delta_apply_s"] = out["v2"]["load_weights_s"] + out["v2"]["first_token_after_s"]
    log(f"sparse delta into the engine: {out}")


def hold_version(model, spec, manifest: bytes, result: dict) -> None:  # noqa: ANN001
    """The validator role's side of stage 5: its resident model (`ResidentPolicies`, one model, other versions as
    steps) takes version 1, the checkpoint's own served form as the engine got it, read in module by module
    (`add`: prepare beside the judging, then commit). The same bytes as version 0: its step must come out empty."""
    from node.roles.resident_policy import ResidentPolicies

    policies = ResidentPolicies(model, 0, manifest)
    state = version1(spec)
    _sync()
    t = time.perf_counter()
    policies.add(1, state, hashlib.sha256(b"real-scale v1").digest())
    _sync()
    result["validator_hold_s"] = time.perf_counter() - t
    result["validator_hold_step_bytes"] = policies.delta_bytes  # version 0 against 1: identical bytes, nothing
    log(f"validator: version 1 held in {result['validator_hold_s']:.1f} s, step of version 0 "
        f"{result['validator_hold_step_bytes']} bytes")


def decode_with_env(engine, cfg, b: int, env: dict[str, str]) -> dict:  # noqa: ANN001
    """`fixed_batch` with `env` set (the FP8 kernels' choices: PRIMERL_FP8_GROUPED, PRIMERL_FP8_GEMM_TILES) and
    the graphs captured again; the environment and the graphs are put back before it returns."""
    before = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update(env)
        engine._graphs.clear()
        engine.capture_all()
        return fixed_batch(engine, cfg, b)
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        engine._graphs.clear()
        engine.capture_all()


VARIANTS = {"fixed_tiles": {"PRIMERL_FP8_GEMM_TILES": "fixed"}, "index_add": {"PRIMERL_MOE_COMBINE": "index_add"}}
"""The kernel choices timed beside the default at the decode batch (`decode_tok_s_b<b>_<name>`): the dense FP8
GEMM's fixed tiles (the default before session 20); the MoE combine's bf16 `index_add_` (the default before
session 25, node/model/moe.py). Session 20's H100 runs timed a swapped grouped kernel here
(`decode_tok_s_b128_swap`: no gain; removed)."""


def claims_of(done: list, reqs: list, cfg) -> tuple[list, bytes]:
    """The engine's completions as honest claims (proofs, routes), as the validator gets them, and the
    manifest hash their proofs name."""
    from node.model.routing import RouteShape, encode_routes
    from verification.claim import RolloutClaim, SamplingSpec
    from verification.proof import prove_rollouts

    manifest = {0: hashlib.sha256(b"real-scale v0").digest()}
    proofs = prove_rollouts([(c.hidden, c.versions) for c in done], manifest)
    shape = RouteShape.of(cfg)
    out = []
    for i, (c, r, proof) in enumerate(zip(done, reqs, proofs)):
        sp = SamplingSpec(temperature=r.params.temperature, top_p=1.0, max_new_tokens=r.params.max_new_tokens,
                          seed=r.params.seed)
        out.append(RolloutClaim(work_id=i, env="random-prompts", task_seed=i, prompt_ids=c.prompt_ids,
                                token_ids=c.token_ids, logprobs=c.logprobs, versions=c.versions, sampling=sp,
                                finish_reason=c.finish_reason, reward=0.0, proof=proof,
                                routed_experts=encode_routes(c.routed_experts.cpu(), shape)))
    return out, manifest[0]


def judge(spec, device: str, claims: list, manifest: bytes, tok, result: dict) -> None:
    from node.replay import TorchReference
    from verification.validator import verify_claims

    t = time.perf_counter()
    model = load_served(spec, device).model
    result["validator_load_s"] = time.perf_counter() - t
    prompts = {c.task_seed: c.prompt_ids for c in claims}
    ref = TorchReference({0: (model, manifest)}, eos_id=tok.eos_id, max_seq_len=spec.model.max_seq_len,
                         decode=tok.decode, tasks=lambda env, seed: prompts[seed], reward=lambda env, seed, ids: 0.0)
    verify_claims(claims[:16], ref)  # warm
    _sync()
    t = time.perf_counter()
    evidence: list = []
    verdicts = verify_claims(claims, ref, evidence=evidence)
    _sync()
    took = time.perf_counter() - t
    tokens = sum(len(c.token_ids) for c in claims)
    rejected = [v for v in verdicts if not v.accepted]
    result.update(verify_s=took, verify_tok_s=tokens / took, verify_rollouts=len(claims),
                  verify_rejected=len(rejected),
                  verify_reasons=sorted({f"{v.reason.value}/{v.severity.value}" for v in rejected}),
                  # which bound a rejected claim crossed, and what the accepted ones measured: for the thresholds
                  verify_rejected_detail=[{"tokens": len(c.token_ids), "chunk": v.chunk, "detail": v.detail,
                                           **e.means(), "chunks": e.chunks}
                                          for c, v, e in zip(claims, verdicts, evidence) if not v.accepted],
                  verify_evidence_max={k: max(e.means()[k] for e in evidence) for k in evidence[0].means()},
                  verify_over_generate=(tokens / took) / result["rl_workload_tok_s"])
    from node.model.packed import varlen_status

    result["judge_varlen"] = varlen_status()
    log(f"validator: {len(claims)} rollouts, {tokens} tokens in {took:.1f}s ({tokens / took:.0f} tok/s, "
        f"{result['verify_over_generate']:.1f}x generation), {len(rejected)} rejected")
    if device != "cpu":  # the same judging the ways before sessions 27, 28 and 29, same GPU, same claims
        for name, var, what in (("torch_replay", "PRIMERL_REPLAY", "torch"),  # the seeded replay in torch ops
                                ("cudnn_sdp", "PRIMERL_JUDGE_SDPA", "cudnn"),  # cuDNN's attention kept
                                ("unfused_fp8", "PRIMERL_FP8_FUSED", "0"),  # FP8 experts as before session 28
                                ("gather_combine", "PRIMERL_MOE_COMBINE", "gather"),  # the MoE combine's torch ops
                                ("padded", "PRIMERL_JUDGE_PACKED", "0")):  # claims padded into rectangles
            judge_again(claims, ref, verdicts, result, name, var, what)
        if tiles := os.environ.get("RS_GROUPED_TILES"):  # the expert GEMM's tiles a sweep found best on this card
            result["judge_grouped_tiles"] = tiles
            judge_again(claims, ref, verdicts, result, "grouped_tiles", "PRIMERL_FP8_GROUPED_TILES", tiles)
    write_result(result["name"], result)  # a run cut later keeps these
    try:  # a failure costs only this figure
        hold_version(model, spec, manifest, result)
    except Exception as exc:  # noqa: BLE001
        result["validator_hold_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        log(f"validator: version 1 not held: {result['validator_hold_error']}")
    write_result(result["name"], result)
    try:  # where judging's time goes (aim: 10x generation): 64 claims again under the profiler
        result["verify_profile"] = prof = profiled(lambda: verify_claims(claims[:64], ref))
        log(f"validator, 64 claims: {prof['wall_s_per_step']:.2f} s, kernels {prof['kernels_s_per_step']:.2f} s: "
            + "; ".join(f"{k['us_per_step'] / 1e3:.0f} ms {k['kernel'][:60]}" for k in prof["top"][:8]))
        log("validator, 64 claims, host: " + "; ".join(f"{k['self_cpu_us_per_step'] / 1e3:.0f} ms {k['op'][:40]} "
                                                       f"x{k['calls_per_step']:.0f}" for k in prof.get("host_top", [])[:10]))
    except Exception as exc:  # noqa: BLE001 - costs only this figure
        log(f"validator profile failed: {type(exc).__name__}: {exc}")
    result["verify_python_profile"] = python_profile(lambda: verify_claims(claims[:64], ref))
    # untimed: the same claims as the role meets them, submissions of 8 judged together (pooled evidence)
    units = [c.model_copy(update={"work_id": i // UNIT}) for i, c in enumerate(claims)]
    pooled = verify_claims(units, ref)
    failed_units = {u.work_id for u, v in zip(units, pooled) if not v.accepted}
    result.update(verify_units=-(-len(units) // UNIT), verify_units_rejected=len(failed_units),
                  verify_units_reasons=sorted({f"{v.reason.value}/{v.severity.value}" for v in pooled if not v.accepted}))
    log(f"validator, submissions of {UNIT}: {len(failed_units)} of {result['verify_units']} rejected")
    write_result(result["name"], result)
    calibrate(claims, ref, evidence, result, [v.accepted for v in verdicts])


def judge_again(claims: list, ref, verdicts: list, result: dict, name: str, var: str, value: str) -> None:  # noqa: ANN001
    """`claims` judged again with the environment variable `var` set to `value` (a way the role judged before):
    `verify_s_{name}` and whether every verdict came out the same (`verify_same_verdicts_{name}`)."""
    from verification.validator import verify_claims

    os.environ[var] = value
    try:
        t = time.perf_counter()
        same = verify_claims(claims, ref)
        _sync()
        result[f"verify_s_{name}"] = time.perf_counter() - t
        result[f"verify_same_verdicts_{name}"] = [v.accepted for v in same] == [v.accepted for v in verdicts]
    finally:
        del os.environ[var]
    log(f"validator, {var}={value}: {result[f'verify_s_{name}']:.1f}s (same verdicts: {result[f'verify_same_verdicts_{name}']})")


def python_profile(fn, top: int = 30) -> dict:  # noqa: ANN001
    """`fn()` once under cProfile (no torch profiler: its per-operator cost is not in this wall): the wall seconds and
    the `top` functions by their own time and by cumulative time, as pstats prints them (for the host's share)."""
    import cProfile
    import io
    import pstats

    _sync()
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    fn()
    _sync()
    pr.disable()
    out = {"wall_s": time.perf_counter() - t}
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(pr, stream=text).sort_stats(key).print_stats(top)
        out[key] = [line.strip()[:200] for line in text.getvalue().splitlines() if line.strip()][-top:]
    log(f"validator, 64 claims under cProfile: {out['wall_s']:.2f} s; by own time: " + " | ".join(out["tottime"][:6]))
    return out


def calibrate(claims: list, ref, evidence: list, result: dict, passed: list[bool], group: int = UNIT,
              write_every: int = 8) -> None:
    """Untimed: every honest claim's own figures along the validator's path (`cross_device_files.drift`, in
    groups of `group`: a 151,936-token vocabulary's logits for 512 rollouts at once would not fit), each bound
    in force against the spread of what it bounds (how many honest claims cross it, and 1.5x the worst: the
    candidate), and the rows written as `pooled_calibration` reads them (`<name>-evidence.jsonl.gz` under $OUT).
    Both are written every `write_every` groups over the claims done so far (`calibration.claims`), so a run
    cut by its time limit keeps what it measured."""
    from benchmarks.cross_device_files import drift
    from types import SimpleNamespace

    rows: list = []
    starts = list(range(0, len(claims), group))
    for n, i in enumerate(starts, 1):
        drift(SimpleNamespace(claims=claims[i:i + group]), ref, rows_out=rows)
        if n % write_every == 0 or n == len(starts):
            _calibration(claims[:len(rows)], ref, evidence, result, passed, rows)
            write_result(result["name"], result)


def _calibration(claims: list, ref, evidence: list, result: dict, passed: list[bool], rows: list) -> None:
    """`calibrate`'s figures and evidence file over `claims` (the first of the run's, measured as `rows`)."""
    from benchmarks.calibration_device import BOUND_OF, MARGIN
    from dataclasses import asdict
    from verification.checks import MIN_MEAN_TOKENS, THRESHOLDS

    figures = [{**asdict(r), "logprob_err_checked_mean": m} for r, m in rows]
    in_force = asdict(THRESHOLDS[ref.precision])
    spread = {}
    for bound, field in BOUND_OF.items():
        f = field.removesuffix("_max")  # the figure of one claim
        vals = sorted(x[f] for x in figures if x.get(f) is not None)
        if not vals:  # no claim measured long enough for this figure yet
            continue
        spread[bound] = {"in_force": in_force[bound], "honest_max": vals[-1], "p50": vals[len(vals) // 2],
                         "p99": vals[min(len(vals) - 1, int(0.99 * len(vals)))],
                         "over_bound": sum(v > in_force[bound] for v in vals), "of": len(vals),
                         "candidate": max(in_force[bound], round(MARGIN * vals[-1], 4))}
    result["calibration"] = {"precision": ref.precision, "min_mean_tokens": MIN_MEAN_TOKENS, "claims": len(rows),
                             "bounds": spread}
    log(f"calibration ({ref.precision}): " + ", ".join(f"{b} max {v['honest_max']:.4g} (bound {v['in_force']}, "
                                                       f"{v['over_bound']} over)" for b, v in spread.items()))
    out = os.environ.get("OUT")
    path = Path(out) if out else Path("benchmarks/results")
    lines = [json.dumps({"precision": ref.precision, "case": "honest", "shape": result["shape"],
                         "engine_device": result["device_name"].replace(" ", "-"),
                         "judge_device": result["device_name"].replace(" ", "-"), "batch": "rl",
                         "work_id": c.work_id // UNIT, "tokens_claimed": len(c.token_ids), "passed_alone": ok,
                         **vars(e), "figures": f})  # work ids: the submissions of 8 the pooled pass judged
             for c, e, f, ok in zip(claims, evidence, figures, passed)]
    (path / f"{result.get('name', 'real_scale')}-evidence.jsonl.gz").write_bytes(
        gzip.compress(("\n".join(lines) + "\n").encode()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--write", action="store_true", help="write the random checkpoint first")
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--fp8", choices=["experts", "all"], default="all")
    ap.add_argument("--vocab-size", type=int, default=151936)
    ap.add_argument("--tokenizer-from", type=Path, default=Path(".gpumodel"))
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--kv-share", type=float, default=0.45,
                    help="the engine's share of free memory for KV (the validator's copy shares the GPU)")
    ap.add_argument("--rl-requests", type=int, default=512)
    ap.add_argument("--decode-batch", type=int, default=256)
    ap.add_argument("--name", default="real_scale")
    ap.add_argument("--release-engine", action="store_true",
                    help="free the engine's GPU memory before the validator loads its copy (an 80 GB card)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the same code (CudaEngine eager)")
    args = ap.parse_args()
    device = args.device
    mem = MemorySampler()
    result: dict = {"name": args.name, "machine": machine_facts(), "shape": args.shape, "fp8": args.fp8, "vocab_size": args.vocab_size,
                    "device_name": torch.cuda.get_device_name(0) if device != "cpu" else "cpu", "note": "every role's model on this one GPU"}
    if args.write:
        from benchmarks.random_checkpoint import SHAPES, write_random_shards
        from node.model.config import ModelConfig

        cfg = ModelConfig(**SHAPES[args.shape], vocab_size=args.vocab_size, max_position_embeddings=40960)
        t = time.perf_counter()
        write_random_shards(cfg, args.dir, args.fp8, device=device, tokenizer_from=args.tokenizer_from)
        result["write_s"] = time.perf_counter() - t
        result["checkpoint_gb"] = sum(f.stat().st_size for f in args.dir.glob("*.safetensors")) / 1e9
        result["params_b"] = cfg.num_parameters() / 1e9
        log(f"checkpoint written: {result['checkpoint_gb']:.1f} GB in {result['write_s']:.0f}s")
        write_result(args.name, result)
        if device != "cpu":
            torch.cuda.empty_cache()
    spec = run_spec(args.dir, args.fp8, args.max_seq_len)
    global T_START
    if args.write:
        T_START = time.perf_counter()  # the launch is timed from here when this process also wrote the checkpoint
    engine, cfg, tok = launch(spec, device, args.kv_share, result)
    result["params_b"] = cfg.num_parameters() / 1e9
    result.update(mem.figures())
    result["launch_host_private_peak_gib"] = result["host_private_peak_gib"]
    write_result(args.name, result)
    b = args.decode_batch
    if engine.max_batch >= b:
        r = fixed_batch(engine, cfg, b)
        result.update({f"decode_tok_s_b{b}": r["decode_tok_s"], f"decode_step_ms_b{b}": r["step_ms"],
                       f"e2e_tok_s_b{b}": r["e2e_tok_s"]})
        log(f"batch {b}: decode {r['decode_tok_s']:.0f} tok/s ({r['step_ms']:.2f} ms/step)")
        for name, env in VARIANTS.items():  # (on the CPU the same code, the torch reference kernels)
            try:  # same engine, same batch; a variant's failure costs only its figure
                v = decode_with_env(engine, cfg, b, env)
                result.update({f"decode_tok_s_b{b}_{name}": v["decode_tok_s"], f"decode_step_ms_b{b}_{name}": v["step_ms"]})
                log(f"batch {b}, {env}: decode {v['decode_tok_s']:.0f} tok/s ({v['step_ms']:.2f} ms/step)")
            except Exception as exc:  # noqa: BLE001
                result[f"decode_b{b}_{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                log(f"decode with {env} failed: {result[f'decode_b{b}_{name}_error']}")
        try:  # where the step's GPU time goes, for the decode aim (a profiler failure costs only this figure)
            result[f"decode_profile_b{b}"] = prof = decode_profile(engine, cfg, b)
            log(f"decode step {prof['wall_s_per_step'] * 1e3:.2f} ms, kernels {prof['kernels_s_per_step'] * 1e3:.2f} ms: "
                + "; ".join(f"{k['us_per_step']:.0f} us {k['kernel'][:60]}" for k in prof["top"][:8]))
        except Exception as exc:  # noqa: BLE001
            log(f"decode profile failed: {type(exc).__name__}: {exc}")
    write_result(args.name, result)
    max_prompt = min(512, args.max_seq_len // 4)
    reqs = rl_requests(cfg, args.rl_requests, max_prompt=max_prompt, max_new=min(1024, args.max_seq_len - max_prompt))
    done = rl_workload(engine, cfg, reqs, result)
    result["gpu_memory_engine_peak_gib"] = _allocated(peak=True) / GIB
    write_result(args.name, result)
    claims, manifest = claims_of(done, reqs, cfg)
    try:  # a failure costs only this figure (the validator's stage still runs)
        apply_version(engine, cfg, spec, result)
    except Exception as exc:  # noqa: BLE001
        result["version_apply_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        log(f"version 1 not applied: {result['version_apply_error']}")
    write_result(args.name, result)
    if "version_apply_error" not in result:
        try:
            apply_delta(engine, cfg, spec, result)
        except Exception as exc:  # noqa: BLE001
            result["delta_apply_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            log(f"sparse delta not applied: {result['delta_apply_error']}")
        write_result(args.name, result)
    if args.release_engine:
        engine.close()
        del engine, done
        gc.collect()  # the engine sits in reference cycles (its graphs hold its bound methods): freed only by gc
        if device != "cpu":
            torch.cuda.empty_cache()
            result["gpu_memory_after_release_gib"] = _allocated() / GIB
        result["note"] = "the engine freed before the validator loaded its copy (--release-engine)"
    judge(spec, device, claims, manifest, tok, result)
    result["gpu_memory_used_gib"] = _allocated(peak=True) / GIB
    result.update(mem.figures())
    write_result(args.name, result)


if __name__ == "__main__":
    main()
