"""A model made on the meta device and filled from its checkpoint's shards, tensor by tensor.

Nothing is allocated before the checkpoint was checked whole from its headers (names, shapes, FP8
scales: node/model/shards.py); then the model's tensors are allocated once, in the target dtype on
the target device, and each is filled as it is read, so peak memory is the model plus one tensor
(one expert's projections). Experts are stacked per layer as their tensors arrive. A module that
stores its weights another way (the engine's FP8 modules, swapped in on the meta model by the
caller's `prepare`) fills itself through `fill_from(name, source)`, quantising or taking a
checkpoint's own e4m3 bytes per tensor: the high-precision model never exists whole beside it.

Invariant: every HF tensor the model needs is read once and hashed as the model holds it (the
digest of node/model/weights_digest.py), whatever order modules are filled in.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from node.model.config import ModelConfig
from node.model.errors import InvalidCheckpoint
from node.model.moe import GroupedExperts
from node.model.qwen3_moe import CausalLM
from node.model.shards import CheckpointShards
from node.model.weights_digest import WeightsDigest, tensor_hexdigest


class WeightSource:
    """What a module reads its weights through: HF-named values in the model's dtype, every read hashed. The
    hashing (an FP8-stored weight dequantised first: the pin is of the value in the run's dtype) runs on a pool
    of `threads` beside the fill (dequantising and hashing release the GIL): inline it was ~4.0 of the fill's
    4.5 s in a CPU profile of a 2-layer Qwen3-30B-A3B slice; a 31 GB FP8 checkpoint's load on an H100 host went
    from 131.3 s inline (session 19) to 33.0-53.2 s with the pool and the e4m3 table of
    `quantization.e4m3_to_float32` (session 20, three calls). At most 2 x `threads` reads wait to be hashed;
    `finish` puts every hash in the digest."""

    def __init__(self, shards: CheckpointShards, dtype: torch.dtype, digest: WeightsDigest, threads: int | None = None):
        self.shards, self.dtype, self.digest = shards, dtype, digest
        n = threads or min(8, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="weights-digest")
        self._room = threading.BoundedSemaphore(2 * n)
        self._pending: dict[str, Future] = {}

    def value(self, name: str) -> torch.Tensor:
        """`name` in the model's dtype, on the CPU (an FP8-stored weight dequantised)."""
        t = self.shards.value(name, self.dtype)
        self._hash(name, lambda: t)
        return t

    def fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(e4m3 weight, float32 128x128 block scales) as the checkpoint stores them, or None when it stores
        `name` in high precision."""
        if not self.shards.is_fp8(name):
            return None
        self._hash(name, lambda: self.shards.value(name, self.dtype))
        return self.shards.fp8(name)

    def _hash(self, name: str, read: Callable[[], torch.Tensor]) -> None:
        """Hash `read()` as `name` on the pool (a name read twice keeps its first hash)."""
        if name in self._pending or name in self.digest.names():
            return
        self._room.acquire()

        def job() -> tuple[torch.dtype, tuple[int, ...], str]:
            try:
                t = read()
                return t.dtype, tuple(t.shape), tensor_hexdigest(t)
            finally:
                self._room.release()
        self._pending[name] = self._pool.submit(job)

    def finish(self) -> None:
        """Wait for every hash and add it to the digest (a read that failed raises here); the pool ends."""
        try:
            for name, future in self._pending.items():
                self.digest.add_hashed(name, *future.result())
            self._pending.clear()
        finally:
            self.abandon()

    def abandon(self) -> None:
        """End the pool without waiting for hashes not started (the fill failed: nothing is pinned)."""
        self._pool.shutdown(cancel_futures=True)


def meta_model(cfg: ModelConfig, dtype: torch.dtype) -> CausalLM:
    """The architecture with no storage: shapes and dtypes only, for a caller to swap modules in and allocate."""
    with torch.device("meta"):
        return CausalLM(cfg).to(dtype)


def allocate(model: CausalLM, device: str | torch.device) -> CausalLM:
    """Storage for a meta model on `device`, in the dtypes it has (uninitialised), ties restored."""
    model = model.to_empty(device=device)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def checkpoint_shapes(model: CausalLM) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the (meta, unswapped) model reads from a checkpoint."""
    from node.model.checkpoint import state_dict_to_hf

    return {name: tuple(t.shape) for name, t in state_dict_to_hf(model).items()}


def check_against(shards: CheckpointShards, shapes: dict[str, tuple[int, ...]], tied: bool) -> None:
    """InvalidCheckpoint naming missing, unexpected or mis-shaped tensors (read from headers only)."""
    have = set(shards.names()) - ({"lm_head.weight"} if tied else set())
    missing, unexpected = sorted(set(shapes) - have), sorted(have - set(shapes))
    if missing or unexpected:
        raise InvalidCheckpoint(f"{shards.directory}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    for name, shape in shapes.items():
        if shards.shape(name) != shape:
            raise InvalidCheckpoint(f"{name}: shape {shards.shape(name)} in checkpoint, model expects {shape}")


def checkpoint_digest(shards: CheckpointShards, cfg: ModelConfig, dtype: torch.dtype, threads: int | None = None) -> str:
    """Version 0's hash of the checkpoint in `dtype`, what `build_from_shards` (and `node.model.spec.load_model`)
    gives, read and hashed a tensor at a time on each of `threads` threads (default: the cores, at most 8;
    reading, casting or dequantising and hashing release the GIL, and the digest does not depend on the order
    tensors arrive in): no model is built, and at most `threads` tensors are held (the trainer's rank 0 before
    it starts from a pinned checkpoint, `model pin`)."""
    shapes = checkpoint_shapes(meta_model(cfg, dtype))
    check_against(shards, shapes, cfg.tie_word_embeddings)
    digest = WeightsDigest()

    def hashed(name: str) -> tuple[str, str]:
        return name, tensor_hexdigest(shards.value(name, dtype))

    with ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1)) as pool:
        for name, hexdigest in pool.map(hashed, shapes):
            digest.add_hashed(name, dtype, shapes[name], hexdigest)
    return digest.hexdigest(expected=set(shapes))


@torch.no_grad()
def build_from_shards(cfg: ModelConfig, shards: CheckpointShards, dtype: torch.dtype, device: str | torch.device,
                      prepare: Callable[[CausalLM], CausalLM] | None = None) -> tuple[CausalLM, str]:
    """(the model filled from `shards` in `dtype` on `device`, its weights hash). `prepare` swaps modules
    on the meta model (FP8 serving) before anything is allocated."""
    model = meta_model(cfg, dtype)
    shapes = checkpoint_shapes(model)
    check_against(shards, shapes, cfg.tie_word_embeddings)
    if prepare is not None:
        model = prepare(model)
    model = allocate(model, device)
    digest = WeightsDigest()
    source = WeightSource(shards, dtype, digest)
    try:
        fill(model, source)
    except BaseException:
        source.abandon()
        raise
    source.finish()
    return model, digest.hexdigest(expected=set(shapes))


def fill(model: nn.Module, source: WeightSource) -> None:
    """Every tensor of `model` (allocated) from `source`, module by module."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        if hasattr(module, "fill_from"):
            module.fill_from(prefix, source)
        elif isinstance(module, GroupedExperts):
            _fill_experts(module, prefix, source)
        else:
            for name, p in module.named_parameters(recurse=False):
                if tied and f"{dot}{name}" == "lm_head.weight":
                    continue
                p.copy_(source.value(f"{dot}{name}"))


def _fill_experts(experts: GroupedExperts, prefix: str, source: WeightSource) -> None:
    inter = experts.down_proj.shape[-1]
    for e in range(experts.num_experts):
        experts.gate_up_proj[e, :inter].copy_(source.value(f"{prefix}.{e}.gate_proj.weight"))
        experts.gate_up_proj[e, inter:].copy_(source.value(f"{prefix}.{e}.up_proj.weight"))
        experts.down_proj[e].copy_(source.value(f"{prefix}.{e}.down_proj.weight"))
