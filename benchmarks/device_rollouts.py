"""Rollouts generated on a device and judged on a device, by the roles' own code: the shared part of the
GPU runs of `benchmarks.false_bans`, `benchmarks.detection_device` and `benchmarks.calibration_device`
(issue 26; `bash benchmarks/xdevice_h200.sh` runs them on one H200).

The engine is the inference role's: on CUDA `CudaEngine` (`builtin-cuda`: a CUDA graph per batch bucket,
all captured before the first request, FP8 quantised on the device by `prepare_model` as `from_setup`
serves it, a new policy version copied in by `load_weights` between two steps); on the CPU `Engine`
(`builtin`; `engine="builtin-cuda"` runs `CudaEngine` eagerly there). The judge is the validator role's:
`TorchReference` with its models on the judging device (on CUDA its `on_device` path: every check on the
GPU) and `verify_claims`. Models are random weights of a named shape (`SHAPES`: real architectures'
widths, the character tokenizer's 88-token vocabulary, `MAX_SEQ` positions) on the reverse task
(tests/verification/rollouts.py). Invariant: an engine and a judge never share a module: each gets its
own copy of the base weights, quantised where it runs.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

from node.engine.fp8.model import apply_fp8_mode
from node.model import CausalLM, ModelConfig
from node.model.routing import RouteShape, encode_routes

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "verification"))
import rollouts as R  # noqa: E402  (the shared harness: tokenizer, tasks, claims)

_QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
                      num_key_value_heads=4, head_dim=128, num_experts_per_tok=8)
SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128, std=0.1),
    "qwen3-moe-tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                           intermediate_size=256, std=0.1),
    "qwen3-moe-small": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                            head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
                            intermediate_size=3072, std=0.02),
    "qwen3-30b-a3b-48l-e16": dict(**_QWEN3_30B_A3B, num_hidden_layers=48, num_experts=16, std=0.02),
    "qwen3-30b-a3b-8l-e16": dict(**_QWEN3_30B_A3B, num_hidden_layers=8, num_experts=16, std=0.02),
    "qwen3-30b-a3b-8l": dict(**_QWEN3_30B_A3B, num_hidden_layers=8, num_experts=128, std=0.02, vocab=49_152),
}
"""Named shapes. `tiny` is the test harness's model (hidden 64); `qwen3-moe-tiny` the cross-device fixture's
(benchmarks/random_checkpoint.py's widths, expert width = hidden); `qwen3-moe-small` the 0.5B network run's
widths; `qwen3-30b-a3b-*-e16` Qwen3-30B-A3B's layer (hidden 2048, 32 query heads of 128, 4 KV heads, top-8
of experts 768 wide) with 16 experts instead of 128 (48 layers: ~4.6B parameters, ~9 GB in bf16).
`std`: the weights' init std (0.1 keeps the 2-layer models' next-token distributions peaked; 0.02 is
random_checkpoint's). `vocab`: the LM head's width where it is not the character tokenizer's 88 (`qwen3-30b-a3b-8l`
is the network run's 5.2B model, `random:qwen3-30b-a3b-8l`, SmolLM2's 49,152-token width; ids past the
alphabet decode to nothing)."""

PRECISIONS: dict[str, tuple[torch.dtype, str]] = {
    "float32": (torch.float32, "off"), "bfloat16": (torch.bfloat16, "off"),
    "fp8-experts-bfloat16": (torch.bfloat16, "experts"), "fp8-all-bfloat16": (torch.bfloat16, "all"),
    "fp8-experts-float32": (torch.float32, "experts"), "fp8-all-float32": (torch.float32, "all"),
}
"""A run's precision (the thresholds' key, verification/checks.py): (base dtype, `ModelSpec.fp8`)."""


def config_of(shape: str, positions: int = R.MAX_SEQ) -> ModelConfig:
    fields = {k: v for k, v in SHAPES[shape].items() if k not in ("std", "vocab")}
    return ModelConfig(vocab_size=SHAPES[shape].get("vocab", R.TOK.vocab_size), max_position_embeddings=positions,
                       **fields)


def shape_facts(shape: str) -> dict:
    cfg = config_of(shape)
    with torch.device("meta"):
        params = sum(p.numel() for p in CausalLM(cfg).parameters())
    return {"name": shape, "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers,
            "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok, "expert_width": cfg.moe_intermediate_size,
            "vocab": cfg.vocab_size, "positions": cfg.max_position_embeddings, "init_std": SHAPES[shape]["std"],
            "params": params}


def random_model(shape: str, dtype: torch.dtype, device: str = "cpu", seed: int = 0,
                 positions: int = R.MAX_SEQ) -> CausalLM:
    """Random weights of `shape` in `dtype`, initialised where they will live (a 4.6B model never passes
    through float32 on the host): norms 1, every other tensor N(0, std). `positions`: its sequence limit."""
    with torch.device("meta"):
        model = CausalLM(config_of(shape, positions))
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, SHAPES[shape]["std"], generator=gen)
    return model.to(dtype).eval()


def noisy(model: CausalLM, size: float, scope: str = "all", seed: int = 1) -> CausalLM:
    """A copy whose weights (layer 0 only, or all; norms untouched) carry Gaussian noise of `size` x each
    tensor's std, drawn where the weights are (benchmarks.weak_tamper.perturbed on any device)."""
    m = copy.deepcopy(model)
    gen = torch.Generator(device=next(m.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or (scope == "layer0" and not name.startswith("model.layers.0.")):
                continue
            w = p.float()
            p.copy_((w + size * w.std() * torch.randn(p.shape, generator=gen, device=p.device)).to(p.dtype))
    return m


def rounded(model: CausalLM, kind: str) -> CausalLM:
    """A copy with its weights rounded per row ('fp8': e4m3, 'int8': symmetric), on their device
    (verification/calibration/perturb.py's rule)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                continue
            w = p.float()
            scale = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
            q = ((w / scale * 448.0).to(torch.float8_e4m3fn).float() / 448.0 if kind == "fp8"
                 else (w / scale * 127.0).round() / 127.0)
            p.copy_((q * scale).to(p.dtype))
    return m


def default_engine(device: str) -> str:
    return "builtin-cuda" if device.startswith("cuda") else "builtin"


def build_engine(model: CausalLM, fp8: str, device: str, max_batch: int, engine: str | None = None,
                 version: int = 0, threads: int | None = None):
    """The inference role's engine serving a copy of `model` (policy `version`; sequences up to its
    `max_position_embeddings`), hidden states and routed experts captured. `builtin-cuda`: `CudaEngine` quantised
    on `device`, graphs captured for every bucket."""
    engine = engine or default_engine(device)
    if threads:
        torch.set_num_threads(threads)
    kwargs = dict(max_batch=max_batch, max_seq_len=model.config.max_position_embeddings, eos_id=R.TOK.eos_id,
                  decode=R.TOK.decode,
                  capture_hidden=True, capture_experts=True, version=version)
    if engine == "builtin":
        from node.engine import Engine

        return Engine(apply_fp8_mode(copy.deepcopy(model), fp8), **kwargs)
    from node.engine.cuda_engine import CudaEngine

    eng = CudaEngine(copy.deepcopy(model), **kwargs, fp8={"off": False, "experts": "experts", "all": True}[fp8],
                     device=device, dtype=next(model.parameters()).dtype)
    eng.capture_all()
    return eng


def hf_weights(model: CausalLM) -> dict[str, torch.Tensor]:
    """A version's tensors as a fetched version hands them to `load_weights` (HF names, on the host)."""
    from node.model.checkpoint import state_dict_to_hf

    return {k: v.detach().cpu() for k, v in state_dict_to_hf(model).items()}


def claims_of(engine, work: list, cfg: ModelConfig) -> list:
    """Honest claims (proofs of the captured hidden states, routes attached) of `engine`'s completions of
    `work` ((task seed, SamplingSpec) pairs), as the validator role builds them from a submission."""
    return claims_from_completions(R.generate(engine, work), work, cfg)


def claims_from_completions(comps: list, work: list, cfg: ModelConfig) -> list:
    """`claims_of` for completions already generated (a benchmark that times the generation apart)."""
    shape = RouteShape.of(cfg)
    return [c.model_copy(update={"routed_experts": encode_routes(comp.routed_experts.cpu(), shape)})
            for c, comp in zip(R.claims_from(comps, work), comps)]


def judge_reference(policies: dict[int, CausalLM], fp8: str, device: str):
    """The validator role's `TorchReference` over `policies` (version -> base model), each copied to
    `device` and quantised there as the run prescribes."""
    return R.reference({v: apply_fp8_mode(copy.deepcopy(m).to(device), fp8) for v, m in policies.items()},
                       max_seq_len=max(m.config.max_position_embeddings for m in policies.values()))


def provenance(device: str) -> dict:
    """Where and with what the numbers were computed: device, torch, CUDA, Triton, kernels, matmul settings."""
    from benchmarks.cross_device_fixture import device_name, numerics, triton_version
    from node.fp8.ops import grouped_backend

    cuda = device.startswith("cuda")
    return {"device": device, "device_name": device_name(device), "torch": torch.__version__,
            "cuda": torch.version.cuda if cuda else None, "triton": triton_version() if cuda else None,
            "kernels": {"decode_attention": "triton" if cuda else "torch reference",
                        "fp8_grouped_gemm": grouped_backend(device),
                        "fp8_dense_gemm": "triton" if cuda else "torch reference",
                        "prefill_attention": "torch sdpa",
                        "prefill_experts": "torch._grouped_mm (bf16)" if cuda else "padded bmm"},
            "numerics": numerics(device), "threads": torch.get_num_threads()}


class ServedEngines:
    """Engines that serve a whole run, one per (precision, weights): built on first use at `max_batch`
    slots, each round's requests decoded at their own number (a bucket of the captured graphs), and a
    round of another policy version preceded by `load_weights` (the version lands between two steps)."""

    def __init__(self, engine: str, device: str, max_batch: int):
        self.engine, self.device, self.max_batch = engine, device, max_batch
        self._engines: dict[tuple[str, str], object] = {}
        self._weights: dict[tuple[str, str, int], dict] = {}

    def serving(self, precision: str, weights: str, version: int, model: CausalLM):
        """The engine of (`precision`, `weights`), serving `version` (`model`: that version's base weights)."""
        key = (precision, weights)
        eng = self._engines.get(key)
        if eng is None:
            eng = self._engines[key] = build_engine(model, PRECISIONS[precision][1], self.device, self.max_batch,
                                                    self.engine, version=version)
        if eng.version != version:
            w = self._weights.get((precision, weights, version))
            if w is None:
                w = self._weights[(precision, weights, version)] = hf_weights(model)
            eng.load_weights(w, version)
        return eng

    def close(self) -> None:
        for eng in self._engines.values():
            eng.close()
        self._engines.clear()


def relabel(claims: list, version: int, hidden_size: int) -> list:
    """A stale node's cheat: the same tokens and proofs, every token claimed as `version` (one proof run
    under that version's manifest; tests/verification/rollouts.py's `relabel` at any hidden size)."""
    from verification.proof import VersionRun, decode_rollout_proof, encode_rollout_proof

    out = []
    for c in claims:
        chunks = [b for r in decode_rollout_proof(c.proof, hidden_size) for b in r.chunks]
        proof = encode_rollout_proof([VersionRun(version, R.manifest(version), len(c.token_ids), chunks)])
        out.append(c.model_copy(update={"versions": [version] * len(c.token_ids), "proof": proof}))
    return out
