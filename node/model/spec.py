"""The run's model, as every member must build it: where the weights come from, their dtype, and the
hash of the initial weights.

Invariant: version 0 is the same tensors on every node. `load_model` hashes the weights as it fills
them (after the dtype cast; node/model/weights_digest.py) and refuses with `WeightsHashMismatch` when
they differ from the spec's pin. Loading is all-or-nothing: the directory's config, tokenizer and
weights (from the shards' headers) are checked, and the memory the model needs is estimated against
what this node has, before anything is allocated; the model is then made on the meta device and
filled tensor by tensor in the spec's dtype on the target device (node/model/fill.py).
The device (`cpu`, `cuda:i`) is the role's choice, not the run's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from protocol.model_spec import TINY_MOE, ModelSpec

from node.model.checkpoint import state_dict_to_hf
from node.model.config import ModelConfig
from node.model.errors import ModelTooLarge, TokenizerMismatch, UnknownModelName, WeightsHashMismatch
from node.model.fill import build_from_shards
from node.model.hf_config import read_config
from node.model.qwen3_moe import CausalLM
from node.model.shards import CheckpointShards
from node.model.tiny import TINY_MAX_SEQ, TinyMoE  # noqa: F401 (callers import them from here)
from node.model.tokenizer import CharTokenizer, HFTokenizer, Tokenizer
from node.model.weights_digest import WeightsDigest

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer
    directory: Path | None
    """HF-layout directory the weights came from (None for the tiny model)."""
    weights_hash: str


def resolve(source: str) -> Path | None:
    """The HF-layout directory behind `source` (None for tiny-moe), converting a registry model once."""
    from node.model.pretrained import SMOLLM2, smollm2_dir

    if source == TINY_MOE:
        return None
    if source == SMOLLM2:
        return smollm2_dir()
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    raise UnknownModelName(f"model {source!r} is neither a directory nor a known name ({TINY_MOE}, {SMOLLM2})")


def model_config(spec: ModelSpec, tiny: TinyMoE | None = None) -> ModelConfig:
    """The architecture as the run uses it (cheap: no weights read, though a registry model may be
    converted once). `max_position_embeddings` is capped at the spec's `max_seq_len`: it is what
    engines size their KV cache by when not told otherwise."""
    directory = resolve(spec.source)
    if directory is None:
        return (tiny or TinyMoE()).config(CharTokenizer().vocab_size)
    cfg = read_config(directory)
    return cfg.model_copy(update={"max_position_embeddings": min(cfg.max_position_embeddings, spec.max_seq_len)})


def weights_hash(model: CausalLM) -> str:
    """The hash of every HF-named tensor of `model` (node/model/weights_digest.py), as `load_model` gives it."""
    digest = WeightsDigest()
    for name, t in state_dict_to_hf(model).items():
        digest.add(name, t)
    return digest.hexdigest()


def available_memory(device: str) -> int:
    """Bytes this node can still allocate on `device` (GPU: free memory; CPU: MemAvailable)."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_fits(cfg: ModelConfig, dtype: str, device: str, copies: float, available: int | None = None) -> int:
    """Estimated bytes (parameters x dtype size x `copies`: 1 to serve, ~4 to train with AdamW); raises
    ModelTooLarge before anything is allocated when they exceed what `device` has."""
    need = int(cfg.num_parameters() * DTYPES[dtype].itemsize * copies)
    have = available_memory(device) if available is None else available
    if need > have:
        raise ModelTooLarge(f"the model needs ~{need / 2**30:.1f} GiB on {device} ({cfg.num_parameters() / 1e6:.0f}M "
                            f"parameters x {DTYPES[dtype].itemsize} B x {copies} copies) but {have / 2**30:.1f} GiB "
                            "is available: use a machine with more memory, another device, or a smaller model")
    return need


def load_model(spec: ModelSpec, device: str = "cpu", copies: float = 1.0, tiny: TinyMoE | None = None,
               prepare: Callable[[CausalLM], CausalLM] | None = None) -> LoadedModel:
    """Build the spec's model and tokenizer on `device`, weights checked against the spec's hash;
    `tiny`: the tiny MoE's shape and seed (the run's recipe), when the source is tiny-moe; `prepare`:
    module swaps made on the meta model before allocation (FP8 serving: `apply_fp8_mode`)."""
    directory = resolve(spec.source)
    cfg = model_config(spec, tiny)
    if directory is None:
        tokenizer: Tokenizer = CharTokenizer()
    else:
        tokenizer = HFTokenizer(directory)
    if tokenizer.vocab_size > cfg.vocab_size or max(tokenizer.stop_ids) >= cfg.vocab_size:
        raise TokenizerMismatch(f"{directory}: the tokenizer has {tokenizer.vocab_size} ids (EOS {tokenizer.eos_id}) but "
                                f"config.json's vocab_size (the embedding) is {cfg.vocab_size}; use the tokenizer "
                                "files that came with these weights")
    if prepare is None:  # with module swaps (FP8: a byte a weight) the caller's memory plan counts the bytes
        check_fits(cfg, spec.dtype, device, copies)
    if directory is None:
        torch.manual_seed((tiny or TinyMoE()).seed)
        model = CausalLM(cfg).to(DTYPES[spec.dtype])  # tiny: drawn in float32 on every member, then cast
        digest = weights_hash(model)
        model = (prepare(model) if prepare is not None else model).to(device)
    else:
        model, digest = build_from_shards(cfg, CheckpointShards(directory), DTYPES[spec.dtype], device, prepare)
    if spec.weights_hash is not None and digest != spec.weights_hash:
        raise WeightsHashMismatch(f"{spec.source}: initial weights hash to {digest}, the run's spec pins "
                                  f"{spec.weights_hash}; fetch the exact checkpoint the run names (or the "
                                  "package version that carries it)")
    return LoadedModel(model.eval(), tokenizer, directory, digest)
