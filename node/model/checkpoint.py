"""Checkpoints in the Hugging Face layout: config.json, safetensors (one file, or shards listed by
model.safetensors.index.json), generation_config.json and the tokenizer's files.

In memory, experts are stacked (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]); on disk each expert has its own `mlp.experts.{e}.{gate,up,down}_proj.weight`, the
layout Qwen3-MoE checkpoints ship in and that `transformers` and vLLM load.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from node.model.config import ModelConfig
from node.model.errors import InvalidCheckpoint, MissingModelFile  # noqa: F401 (callers import it from here)
from node.model.quantization import BLOCK, scale_shape
from node.model.qwen3_moe import CausalLM
from node.model.shards import INDEX, WEIGHTS, CheckpointShards
from node.model.streamed_weights import IndexedTensors, headers

CONFIG = "config.json"
COMPANION_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")
"""Files that travel with the weights so a saved checkpoint opens in transformers/vLLM with its tokenizer."""
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def state_dict_to_hf(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under HF names, experts unstacked, tied weights written once."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        m = _STACKED.match(name)
        if not m:
            out[name] = t.detach().contiguous()
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
    return out


class InternalTensors(IndexedTensors):
    """HF-named tensors under the model's internal names (experts stacked [E, ...]), checked from their
    headers and each built when looked up: a stacked expert tensor is one layer's experts, copied in
    expert by expert at that moment, so a caller that goes tensor by tensor holds one layer's experts
    beside what it loads into, never the whole model's (InvalidCheckpoint for missing or mis-shaped
    experts)."""

    def __init__(self, sd: Mapping[str, torch.Tensor], cfg: ModelConfig):
        self.sd, self.cfg = sd, cfg
        heads = headers(sd)
        self._plain: dict[str, str] = {}
        """internal name -> the HF name it is (everything but routed experts)."""
        self._experts: dict[str, dict[int, dict[str, str]]] = {}
        for name in heads:
            m = _PER_EXPERT.match(name)
            if m:
                self._experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = name
            else:
                self._plain[name] = name
        if cfg.tie_word_embeddings and "lm_head.weight" not in self._plain and "model.embed_tokens.weight" in self._plain:
            self._plain["lm_head.weight"] = "model.embed_tokens.weight"
        self.index = {n: heads[hf] for n, hf in self._plain.items() if n == hf}
        for prefix, by_e in self._experts.items():
            if sorted(by_e) != list(range(cfg.num_experts)):
                raise InvalidCheckpoint(f"{prefix}: expected experts 0..{cfg.num_experts - 1}, found {sorted(by_e)}")
            try:
                kinds = {k: {heads[by_e[e][k]] for e in by_e} for k in ("gate_proj", "up_proj", "down_proj")}
            except KeyError as exc:
                raise InvalidCheckpoint(f"{prefix}: incomplete expert weights (no {exc})") from exc
            if any(len(v) != 1 for v in kinds.values()):
                raise InvalidCheckpoint(f"{prefix}: experts of different shapes or dtypes")
            ((gate, dtype),), ((up, _),), ((down, _),) = kinds.values()
            if gate[1:] != up[1:]:
                raise InvalidCheckpoint(f"{prefix}: gate {gate} and up {up} projections do not stack")
            self.index[f"{prefix}.gate_up_proj"] = ((len(by_e), gate[0] + up[0], *gate[1:]), dtype)
            self.index[f"{prefix}.down_proj"] = ((len(by_e), *down), dtype)
        if self._plain.get("lm_head.weight", "lm_head.weight") != "lm_head.weight":
            self.index["lm_head.weight"] = heads["model.embed_tokens.weight"]  # tied: the embedding again, last

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._plain:
            return self.sd[self._plain[name]]
        parts = self.pieces(name)
        shape, dtype = self.index[name]
        out = torch.empty(shape, dtype=dtype, device=parts[0][1].device)  # where the version's tensors are
        for at, t in parts:
            out[at].copy_(t)
        return out

    def pieces(self, name: str) -> list[tuple[tuple, torch.Tensor]]:
        """The HF tensors internal tensor `name` is made of, each with where it lands in it (an index:
        () for the whole tensor, (expert, rows) for a stacked expert's projection)."""
        return [(at, self.sd[hf]) for at, hf in self._piece_names(name)]

    def _piece_names(self, name: str) -> list[tuple[tuple, str]]:
        if name in self._plain:
            return [((), self._plain[name])]
        if name not in self.index:
            raise KeyError(name)
        prefix, kind = name.rsplit(".", 1)
        by_e = self._experts[prefix]
        heads = headers(self.sd)
        kinds = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
        out = []
        for e in range(self.index[name][0][0]):
            at = 0
            for k in kinds:
                rows = heads[by_e[e][k]][0][0]
                out.append(((e, slice(at, at + rows)), by_e[e][k]))
                at += rows
        return out

    def fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Internal tensor `name` as (e4m3, 128x128 block scales) when a version in its served form
        (node/model/served_form.py) holds it so; None when it holds it in high precision (its value is
        `self[name]`). `InvalidCheckpoint` as `check_fp8` says."""
        pairs = self._fp8_pieces(name)
        if pairs is None:
            return None
        if pairs[0][0] == ():
            return pairs[0][1]
        shape = self.index[name][0]
        device = pairs[0][1][0].device
        q = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
        s = torch.empty(scale_shape(shape), dtype=torch.float32, device=device)
        for (e, rows), (pq, ps) in pairs:
            q[e, rows].copy_(pq)
            s[e, rows.start // BLOCK : rows.start // BLOCK + ps.shape[0]].copy_(ps)
        return q, s

    def check_fp8(self) -> None:
        """`InvalidCheckpoint` for a version in its served form with a tensor whose pieces come some in e4m3
        and some not, or in e4m3 rows off 128-row block edges (the engines refuse it too: `weight_staging`);
        nothing is read. Call it before loading anything."""
        quantised = getattr(self.sd, "quantised", None)  # a served form's e4m3 names: no tensor looked up
        for name in self.index:
            if quantised is None:
                self._fp8_pieces(name)
            else:
                self._check_pieces(name, [(at, hf in quantised) for at, hf in self._piece_names(name)])

    def _check_pieces(self, name: str, raw: list[tuple[tuple, bool]]) -> bool:
        """Whether `name`'s pieces ((where, whether in e4m3) each) come in e4m3: all or none, on block edges."""
        if not any(r for _, r in raw):
            return False
        if not all(r for _, r in raw) or any(at and at[1].start % BLOCK for at, _ in raw):
            raise InvalidCheckpoint(f"{name}: its pieces come partly in e4m3, or in e4m3 rows off 128-row block edges")
        return True

    def _fp8_pieces(self, name: str) -> list[tuple[tuple, tuple[torch.Tensor, torch.Tensor]]] | None:
        get = getattr(self.sd, "fp8", None)
        if get is None or name not in self.index:
            return None
        pairs = [(at, get(hf)) for at, hf in self._piece_names(name)]
        return pairs if self._check_pieces(name, [(at, p is not None) for at, p in pairs]) else None


def hf_to_internal(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Stack per-expert HF tensors into the in-memory layout; other names pass through (all at once:
    `InternalTensors` builds one tensor at a time)."""
    internal = InternalTensors(sd, cfg)
    return {name: internal[name] for name in internal}


def load_hf_state_dict(model: CausalLM, sd: dict[str, torch.Tensor]) -> None:
    """Copy HF-named weights into `model` in place; every parameter must be present with its shape
    (an FP8-served model quantises them on arrival)."""
    internal = hf_to_internal(sd, model.config)
    own = model.state_dict()
    missing = sorted(set(own) - set(internal))
    unexpected = sorted(set(internal) - set(own))
    if missing or unexpected:
        raise InvalidCheckpoint(f"missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    for name, t in internal.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise InvalidCheckpoint(f"{name}: shape {tuple(t.shape)} in checkpoint, model expects {tuple(own[name].shape)}")
    with torch.no_grad():
        # load_state_dict, not copies into state_dict()'s tensors: an FP8 model's state_dict() is dequantised
        # copies, and its modules quantise what they load (node/engine/fp8/model.py); plain ones copy in place
        model.load_state_dict(internal, strict=True)


class CheckpointNotWritten(RuntimeError):
    """A checkpoint could not be written (the disk, its room, a write that failed); the previous one, if any, is
    intact and nothing of the new one is left."""


class CheckpointDoesNotFit(CheckpointNotWritten):
    """Found before anything was written: the checkpoint needs more bytes than its filesystem has free."""


STAGING_SUFFIX, PREVIOUS_SUFFIX = ".partial", ".previous"
ROOM_SLACK = 64 << 20
"""Bytes a checkpoint may take beyond its tensors' (safetensors headers, config and tokenizer files)."""


def recover(directory: str | Path) -> None:
    """Finish a swap that `written_whole` began and a crash cut: the new checkpoint was written whole before
    the previous one was moved aside, so whichever of them is in place (or, between the two renames, the
    previous one) is whole. A staging directory left by a crash mid-write goes."""
    directory = Path(directory)
    previous = directory.with_name(directory.name + PREVIOUS_SUFFIX)
    if previous.exists():
        if directory.exists():
            shutil.rmtree(previous, ignore_errors=True)
        else:
            previous.rename(directory)
    shutil.rmtree(directory.with_name(directory.name + STAGING_SUFFIX), ignore_errors=True)


def ensure_room(directory: str | Path, need_bytes: int, what: str) -> None:
    """`CheckpointDoesNotFit` naming the numbers when `directory`'s filesystem has not `need_bytes` (and the
    slack of its small files) free."""
    free = shutil.disk_usage(directory).free
    if need_bytes + ROOM_SLACK > free:
        raise CheckpointDoesNotFit(f"{what} needs {(need_bytes + ROOM_SLACK) / 2**30:.2f} GiB, "
                                   f"{free / 2**30:.2f} GiB free on its filesystem")


@contextmanager
def written_whole(directory: str | Path, need_bytes: int) -> Iterator[Path]:
    """A directory beside `directory` to write a checkpoint of about `need_bytes` into; once the block ends it
    replaces `directory` (the previous checkpoint goes only then). A checkpoint is so written whole or not at
    all: `CheckpointDoesNotFit` before anything is written when its filesystem has not the room for it beside
    the previous one; `CheckpointNotWritten` when a write fails, with the staging directory removed and the
    previous checkpoint as it was (a trainer resumed from a half-overwritten directory had mixed weights, AdamW
    state and step; session 22's 5.2B runs on one H200 died writing into a full disk)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    recover(directory)
    staging = directory.with_name(directory.name + STAGING_SUFFIX)
    ensure_room(directory.parent, need_bytes, what=f"checkpoint {directory}")
    staging.mkdir()
    try:
        yield staging
        for f in staging.iterdir():  # on disk before the swap makes it the checkpoint
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    except (OSError, SafetensorError) as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointNotWritten(f"checkpoint {directory} not written ({exc}); "
                                   f"{'the previous one is kept' if directory.exists() else 'there is none'}") from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if directory.exists():
        previous = directory.with_name(directory.name + PREVIOUS_SUFFIX)
        directory.rename(previous)
        staging.rename(directory)
        shutil.rmtree(previous, ignore_errors=True)
    else:
        staging.rename(directory)


def save_checkpoint(model: CausalLM, directory: str | Path, metadata: dict[str, str] | None = None,
                    companions_from: str | Path | None = None, max_shard_bytes: int | None = None) -> Path:
    """Write `model` in the HF layout; `companions_from`: the model directory the weights came from,
    whose config.json fields, tokenizer files (with the chat template) and generation config are
    written alongside, so the result opens in transformers and vLLM as the original did;
    `max_shard_bytes`: split weights into shards + index."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    (directory / CONFIG).write_text(json.dumps(hf_config_for(model.config, dtype, companions_from), indent=2))
    save_tensors(state_dict_to_hf(model), directory, metadata or {"format": "pt"}, max_shard_bytes)
    if companions_from is not None:
        copy_companions(companions_from, directory)
    return directory


def save_tensors(tensors: Mapping[str, torch.Tensor], directory: Path, metadata: dict[str, str],
                 max_shard_bytes: int | None = None) -> None:
    """HF-named `tensors` as safetensors in `directory`: one file, or shards of at most `max_shard_bytes`
    (one tensor may exceed it) listed by the index. Sizes come from the tensors' headers and each shard's
    tensors are looked up only while it is written, so a version read from disk tensor by tensor
    (node/model/streamed_weights.py) is on the host one shard at a time."""
    sizes = {name: math.prod(shape) * dtype.itemsize for name, (shape, dtype) in headers(tensors).items()}
    if max_shard_bytes is None:
        save_file({name: tensors[name].contiguous() for name in sizes}, str(directory / WEIGHTS), metadata=metadata)
        return
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: tensors[name].contiguous() for name in names}, str(directory / fname), metadata=metadata)
        weight_map.update(dict.fromkeys(names, fname))
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map},
                                              indent=2))


def hf_config_for(cfg: ModelConfig, dtype: str, source: str | Path | None = None) -> dict:
    """config.json for `cfg`. With `source` (the model directory the weights started from), its own
    config.json is written back with only the dtype changed, so what the model was published with
    (token ids, the full max_position_embeddings a run may have capped) survives training; a source
    of another architecture is refused (its tokenizer would not fit these weights either)."""
    ours = cfg.to_hf_dict(dtype)
    path = None if source is None else Path(source) / CONFIG
    if path is None or not path.exists():
        return ours
    from node.model.hf_config import read_config

    theirs = read_config(path)
    if theirs.model_copy(update={"max_position_embeddings": cfg.max_position_embeddings}) != cfg:
        raise InvalidCheckpoint(f"{path} describes another model than the one being saved; save with the "
                                "companion files of the checkpoint these weights were loaded from")
    raw = json.loads(path.read_text())
    for key in [k for k in ("dtype", "torch_dtype") if k in raw] or ["torch_dtype"]:  # transformers 5 / 4
        raw[key] = dtype
    return raw


def copy_companions(source: str | Path, directory: str | Path) -> None:
    """Copy the tokenizer and generation config of model directory `source` into `directory`."""
    for name in COMPANION_FILES:
        src, dst = Path(source) / name, Path(directory) / name
        if src.exists() and src.resolve() != dst.resolve():
            shutil.copyfile(src, dst)


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF-layout directory (model.safetensors, or the shards its index lists) as one
    dict, for callers that hand a whole version on (tests, fixtures): models load through
    `load_checkpoint` / `node.model.spec.load_model`, tensor by tensor. FP8 weights come dequantised
    to bfloat16, other tensors as stored."""
    shards = CheckpointShards(directory)
    return {name: shards.value(name, torch.bfloat16) if shards.is_fp8(name) else shards.raw(name)
            for name in shards.names()}


def load_checkpoint(directory: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> CausalLM:
    """The model in an HF-layout directory, filled tensor by tensor in `dtype` on `device`; every config
    field used or refused, every tensor present."""
    from node.model.fill import build_from_shards

    directory = Path(directory)
    model, _ = build_from_shards(ModelConfig.from_file(directory / CONFIG), CheckpointShards(directory), dtype, device)
    return model
