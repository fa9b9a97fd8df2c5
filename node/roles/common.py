"""What every role shares: the run's model and task from the spec's recipe (`node.recipe`), fetching
a policy version through shardcast, and a stop event wired to SIGINT/SIGTERM. Roles talk to the
coordinator only through `protocol.client.CoordinatorClient` (retries, re-joins, reply types).

Invariant: a role never trusts weights it did not verify (shardcast checks the trainer's signature
and every shard hash).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from node.envs import get_env
from node.model.config import ModelConfig
from node.model.qwen3_moe import CausalLM
from node.model.errors import MismatchedScales, WeightsHashMismatch
from node.model.fill import allocate, check_against, checkpoint_shapes, meta_model
from node.model.served_form import ServedForm, served
from node.model.shards import CheckpointShards
from node.model.weights_digest import WeightsDigest
from node.model.spec import DTYPES, TinyMoE, load_model, resolve
from node.model.spec import model_config as spec_model_config
from node.model.tokenizer import CharTokenizer, HFTokenizer, Tokenizer
from node.recipe import Recipe
from protocol.errors import ProtocolError
from protocol.messages import RunSpec
from protocol.model_spec import FP8Mode
from shardcast.codec import TensorBytes
from shardcast.fetch import fetch_version
from shardcast.manifest import Manifest, TrustedPublishers
from shardcast.store import Store
from node.stop_signals import dump_tasks, stop_on_signals  # noqa: F401 (roles import them from here)

log = logging.getLogger(__name__)

KEEP_BEYOND_K = 4
"""Versions a store keeps beyond the off-policy bound k (the trainer's and the relay's retention too)."""

def router_replay(spec: RunSpec) -> bool:
    """Whether the run asks for routed experts to travel and be replayed (and its model has MoE layers)."""
    return Recipe.of(spec).router_replay and bool(model_config(spec).moe_layer_indices)


def tiny_shape(spec: RunSpec) -> TinyMoE:
    """The tiny MoE's shape and seed from the run's recipe (used when the spec's model is tiny-moe)."""
    return Recipe.of(spec).tiny_shape()


def model_config(spec: RunSpec) -> ModelConfig:
    """The run's model architecture (`RunSpec.model`; node/model/spec.py)."""
    return spec_model_config(spec.model, tiny_shape(spec))


def check_device(device: str) -> None:
    """`cpu`, `cuda` or `cuda:i` for a role's model (`join --device`; checked before the role starts, not at
    its first forward pass); `cuda:i` becomes the main thread's current device."""
    if device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ValueError(f"--device {device!r}: expected cpu, cuda or cuda:<index>")
    if device != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device on this machine")
    if device.startswith("cuda:"):
        index = int(device[5:])
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        torch.cuda.set_device(index)  # the main thread's current device (engines set their worker threads')


def fresh_model(spec: RunSpec, device: str = "cpu") -> CausalLM:
    """Version 0 of the run's model on `device`, its weights checked against the spec's hash."""
    return load_model(spec.model, device, tiny=tiny_shape(spec)).model.eval()


def blank_model(spec: RunSpec, device: str = "cpu", fp8: FP8Mode = "off") -> CausalLM:
    """The run's architecture on `device` with uninitialised weights, for a role that loads a
    fetched version into it at once: no weights read from disk, nothing hashed (a 135M model costs
    seconds of CPU per version otherwise, enough to miss heartbeats). Made on the meta device and
    allocated once in the spec's dtype; with `fp8` the FP8 modules are swapped in before allocation,
    so no high-precision copy of what they hold is ever made."""
    from node.engine.fp8.model import apply_fp8_mode

    model = apply_fp8_mode(meta_model(model_config(spec), DTYPES[spec.model.dtype]), fp8)
    return allocate(model, device).eval()


def check_checkpoint(spec: RunSpec) -> None:
    """The run's checkpoint, checked from its files' headers before a role allocates anything: config.json
    (a quantisation we do not load is refused), every shard the index lists, every tensor's name and shape
    against the architecture, FP8 scales against their weights (typed ModelLoadError: `join` exits 2)."""
    directory = resolve(spec.model.source)
    if directory is None:
        return
    cfg = model_config(spec)
    check_against(CheckpointShards(directory), checkpoint_shapes(meta_model(cfg, DTYPES[spec.model.dtype])),
                  cfg.tie_word_embeddings)


def check_version0(spec: RunSpec, weights: Mapping[str, torch.Tensor]) -> None:
    """Version 0 as fetched (HF-named tensors, looked up one at a time: no model is built to hash them) must
    hash to the spec's pin as a model of the spec's dtype holding them would (WeightsHashMismatch otherwise)."""
    pinned = spec.model.weights_hash
    if pinned is None:
        return
    if isinstance(weights, ServedForm) and weights.quantised:
        # the pin is of the checkpoint's values; e4m3 bytes and block scales do not give them back
        log.info("version 0 of run %s is in its served form (%d tensors in e4m3): the spec's pin covers the "
                 "checkpoint's values, which only a member holding the checkpoint checks; this one has the "
                 "trainer's signature and the shards' hashes", spec.run_id, len(weights.quantised))
        return
    digest, dtype = WeightsDigest(), DTYPES[spec.model.dtype]
    for name in weights:
        digest.add(name, weights[name].to(dtype))
    if (got := digest.hexdigest()) != pinned:
        raise WeightsHashMismatch(f"version 0 of run {spec.run_id} hashes to {got}, its spec pins {pinned}")


def tokenizer(spec: RunSpec) -> Tokenizer:
    """The run's tokenizer: the checkpoint's own, or the tiny model's character tokenizer."""
    directory = resolve(spec.model.source)
    return CharTokenizer() if directory is None else HFTokenizer(directory)


def environment(spec: RunSpec):
    return get_env(spec.environment)


async def retain_policies(spec: RunSpec, store: Store) -> None:
    """The store's retention (`Store.retain`): a role on a host of its own keeps its store bounded too (beside
    the trainer it shares the trainer's)."""
    await asyncio.to_thread(store.retain, spec.run_id, spec.max_off_policy_steps + KEEP_BEYOND_K)


async def fetch_policy(spec: RunSpec, store: Store, version: int, expect_hash: str | None = None,
                       tries: int = 20, stages: dict | None = None,
                       local: Callable[[Manifest], TensorBytes | None] | None = None,
                       retain: bool = True, changes_of: int | None = None) -> dict[str, torch.Tensor]:
    """Version `version` of the run's policy, verified (trainer's signature, shard hashes, and the
    manifest hash the coordinator announced, when given). `stages`, when given, gets where the fetch's
    time went (`FetchedVersion.stages_s`: download, verify, decode, write; empty when the store held it).
    `local`: the member's own copy of a delta's parent (the role's `version0.LocalVersion0`). `retain`: the
    store's retention runs before the version is returned (False: the caller runs `retain_policies` once it
    has put the version to use; deleting an old 10 GB payload from tmpfs took ~0.2 s of the 5.2B node's
    fetch, session 32). `changes_of`: a version the caller holds, whose bytes the result's changed bytes are
    against where the store holds both (`shardcast.fetch.Fetcher.fetch`)."""
    trusted = TrustedPublishers([spec.trainer] if spec.trainer else [])
    last: Exception | None = None
    for attempt in range(tries):
        try:
            got = await fetch_version(store, list(spec.shardcast_sources), trusted, spec.run_id, version, local=local,
                                      changes_of=changes_of)
            if expect_hash is not None and got.manifest.manifest_hash() != expect_hash:
                raise ProtocolError(f"v{version}: manifest hash differs from the announced one")
            if retain:
                await retain_policies(spec, store)
            if stages is not None:
                stages.update(got.stages_s, wire_bytes_downloaded=got.wire_bytes_downloaded)
            # views over the payload file's (copy-on-write) mapping, no copy: an engine copies each tensor where it is
            # served (node/engine/weight_staging.py), so the event loop never clones the whole model; an FP8 run's
            # version in its served form reads as the values it holds (node/model/served_form.py)
            try:
                return served(got.tensors(), DTYPES[spec.model.dtype])
            except MismatchedScales as exc:
                raise ProtocolError(f"v{version}: {exc}") from exc
        except ProtocolError as exc:
            last = exc
            await asyncio.sleep(min(0.2 * (attempt + 1), 2.0))
    raise ProtocolError(f"could not fetch policy v{version}: {last}")

