"""The check a policy version passes before any engine copies it in, and where each tensor lands.

Checked whole, before one tensor is copied, so a refused version leaves the served weights as they
were and the engine keeps serving the version it has. `plan_weights` maps every HF-named tensor of a
version to its place in the served model (a whole parameter, or one expert's rows of a stacked
expert tensor), so an engine copies each tensor straight where it belongs: no stacked copy of the
experts is ever built on the host (`node.engine.weight_staging` does the copies).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from node.model.checkpoint import InternalTensors, InvalidCheckpoint
from node.model.config import ModelConfig
from node.model.quantization import BLOCK
from node.model.qwen3_moe import CausalLM
from node.model.streamed_weights import headers

_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
"""An expert's tensor under its HF name (node/model/checkpoint.py writes and reads this layout)."""


class WeightsMismatch(InvalidCheckpoint):
    """A policy version whose tensors do not match the served model (names, shapes or dtype kind);
    refused before anything is copied, so the engine keeps serving the version it has."""


@dataclass(frozen=True)
class Target:
    """Where one HF-named tensor lands: `internal` (a served tensor's name), indexed by `expert` and `rows`."""

    internal: str
    expert: int | None = None
    """Row of a stacked expert tensor [E, ...] (None: the whole tensor)."""
    rows: tuple[int, int] | None = None
    """Rows within that expert (gate and up share `gate_up_proj`: gate first)."""

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """The part of `t` (shaped as `internal`) this target names: contiguous in a contiguous `t`."""
        if self.expert is not None:
            t = t[self.expert]
        return t if self.rows is None else t[self.rows[0] : self.rows[1]]

    def scale_view(self, s: torch.Tensor) -> torch.Tensor:
        """The part of the block scales `s` of `internal` (e4m3, 128x128 blocks) this target names: its rows
        start and end on block edges (`StagedVersion.of` checks it)."""
        if self.expert is not None:
            s = s[self.expert]
        return s if self.rows is None else s[self.rows[0] // BLOCK : self.rows[1] // BLOCK]

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        shape = full[1:] if self.expert is not None else full
        return shape if self.rows is None else (self.rows[1] - self.rows[0], *shape[1:])


def expected_shapes(model: CausalLM) -> dict[str, tuple[int, ...]]:
    """Internal tensor names and shapes of the model as built (before any quantisation), read from a
    meta twin: an FP8 model's state_dict() would dequantise every weight."""
    with torch.device("meta"):
        twin = CausalLM(model.config)
    return {name: tuple(t.shape) for name, t in twin.state_dict().items()}


def target_of(name: str, shapes: dict[str, tuple[int, ...]]) -> Target:
    m = _PER_EXPERT.match(name)
    if m is None:
        return Target(name)
    prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
    if kind == "down_proj":
        return Target(f"{prefix}.down_proj", e)
    inter = shapes.get(f"{prefix}.gate_up_proj", (0, 0))[1] // 2
    return Target(f"{prefix}.gate_up_proj", e, (0, inter) if kind == "gate_proj" else (inter, 2 * inter))


def plan_weights(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig,
                 shapes: dict[str, tuple[int, ...]]) -> dict[str, Target]:
    """HF name -> `Target` for every tensor of a version, or `WeightsMismatch` naming what does not fit
    `shapes` (a missing or unexpected tensor, a wrong shape, an expert missing, a non-float dtype)."""
    need = {n: (full[0] * (2 if n.endswith(".gate_up_proj") else 1) if ".mlp.experts." in n else 1)
            for n, full in shapes.items()}
    """Pieces that fill each served tensor: every expert's gate and up rows, or down; 1 for the rest."""
    plan: dict[str, Target] = {}
    covered: dict[str, int] = {}
    for name, (shape, dtype) in headers(state_dict).items():  # a streamed version: nothing read yet
        target = target_of(name, shapes)
        full = shapes.get(target.internal)
        if full is None or (target.expert is not None and target.expert >= full[0]):
            raise WeightsMismatch(f"unexpected tensors ['{name}']")
        if shape != target.shape(full):
            raise WeightsMismatch(f"{name}: shape {shape}, the served model has {target.shape(full)}")
        if not dtype.is_floating_point:
            raise WeightsMismatch(f"{name}: dtype {dtype} is not a float type")
        plan[name] = target
        # a stacked expert tensor given whole (internal names are accepted too) fills all its pieces
        covered[target.internal] = covered.get(target.internal, 0) + (1 if target.expert is not None else need[target.internal])
    if cfg.tie_word_embeddings and "lm_head.weight" in shapes and "lm_head.weight" not in covered:
        covered["lm_head.weight"] = int("model.embed_tokens.weight" in covered)  # the same tensor, loaded once
    missing = sorted(n for n, k in need.items() if covered.get(n, 0) != k)
    if missing:
        raise WeightsMismatch(f"missing tensors {missing[:5]}")
    return plan


def check_weights(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig,
                  shapes: dict[str, tuple[int, ...]]) -> InternalTensors:
    """HF-named tensors -> internal names (experts stacked when a tensor is looked up: one layer's at a
    time), checked whole from the tensors' headers, or `WeightsMismatch`; for the expert-parallel engine,
    which scatters the stacked tensors over its ranks."""
    try:
        internal = InternalTensors(state_dict, cfg)
    except InvalidCheckpoint as exc:
        raise WeightsMismatch(str(exc)) from exc
    missing = sorted(set(shapes) - set(internal))
    unexpected = sorted(set(internal) - set(shapes))
    if missing or unexpected:
        raise WeightsMismatch(f"missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    for name, (shape, dtype) in internal.index.items():
        if shape != shapes[name]:
            raise WeightsMismatch(f"{name}: shape {shape}, the served model has {shapes[name]}")
        if not dtype.is_floating_point:
            raise WeightsMismatch(f"{name}: dtype {dtype} is not a float type")
    return internal
