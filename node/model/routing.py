"""Routed experts on the wire: which experts each position was sent to, as compact bytes.

The engine records, for every position it fed to the model (prompt + completion - 1 of them: the
last token is sampled, never fed), the top-k experts of every MoE layer: a tensor
[positions, moe_layers, k]. That is exactly what the trainer's forward over (prompt +
completion)[:-1] replays (`node.rl.batch.build_batch`, `CausalLM.forward(routed_experts=...)`).

Wire form: the ids in C order (position, layer, slot), one byte each when the model has at most
256 experts, else two bytes little-endian. Nothing else travels: the reader knows the shape from
the run's model and the rollout's length, so `decode_routes` refuses bytes of any other length
or an expert id outside the model (`InvalidRoutes`), never returns a tensor it could not vouch for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from node.model.config import ModelConfig


class InvalidRoutes(ValueError):
    """Route bytes that do not describe this model's routing of this many positions."""


@dataclass(frozen=True)
class RouteShape:
    """What a reader must know to decode routes: the model's MoE layout."""

    moe_layers: int
    """MoE layers per forward (dense layers route nothing)."""
    top_k: int
    """Experts per token per layer."""
    num_experts: int
    """Experts per MoE layer (picks one or two bytes per id)."""

    @classmethod
    def of(cls, cfg: ModelConfig) -> "RouteShape | None":
        """The shape of `cfg`'s routes, or None for a dense model (nothing to route)."""
        layers = len(cfg.moe_layer_indices)
        return cls(layers, cfg.num_experts_per_tok, cfg.num_experts) if layers else None

    @property
    def id_bytes(self) -> int:
        return 1 if self.num_experts <= 256 else 2

    def nbytes(self, positions: int) -> int:
        return positions * self.moe_layers * self.top_k * self.id_bytes


def _dtype(shape: RouteShape) -> np.dtype:
    return np.dtype(np.uint8) if shape.id_bytes == 1 else np.dtype("<u2")


def encode_routes(routes: torch.Tensor, shape: RouteShape) -> bytes:
    """[positions, moe_layers, k] expert ids -> bytes (refuses a tensor of another layout)."""
    if routes.dim() != 3 or tuple(routes.shape[1:]) != (shape.moe_layers, shape.top_k):
        raise InvalidRoutes(f"routes of shape {tuple(routes.shape)}, expected [positions, {shape.moe_layers}, "
                            f"{shape.top_k}]")
    ids = routes.detach().cpu().to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= shape.num_experts):
        raise InvalidRoutes(f"expert id outside [0, {shape.num_experts})")
    return ids.numpy().astype(_dtype(shape)).tobytes()


_NUMPY_INT = {torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32}
"""`compact_routes_dtype`'s dtypes as numpy names them."""


def compact_routes_dtype(shape: RouteShape) -> torch.dtype:
    """The narrowest torch integer dtype that holds `shape`'s expert ids: uint8 up to 256 experts, else int16 (int32
    beyond 32,768). A trainer's batch keeps its routes in it, 8 (4) times fewer bytes than int64 to copy, pin and
    move to the GPU each pass (a 48-layer Qwen3-30B-A3B batch of 256 rows x 1,228 positions: 965 MB as int64, 121 MB as
    uint8); `CausalLM.forward` widens them on the device."""
    return torch.uint8 if shape.id_bytes == 1 else torch.int16 if shape.num_experts <= 2**15 else torch.int32


def decode_routes(data: bytes, positions: int, shape: RouteShape, compact: bool = False) -> torch.Tensor:
    """bytes -> [positions, moe_layers, k] long tensor (`compact`: in `compact_routes_dtype`); `InvalidRoutes`
    on a wrong length or an id outside the model's experts."""
    want = shape.nbytes(positions)
    if positions < 0 or len(data) != want:
        raise InvalidRoutes(f"{len(data)} route bytes for {positions} positions, expected {want}")
    ids = np.frombuffer(data, dtype=_dtype(shape))
    if ids.size and int(ids.max()) >= shape.num_experts:
        raise InvalidRoutes(f"expert id {int(ids.max())} outside [0, {shape.num_experts})")
    wide = _NUMPY_INT[compact_routes_dtype(shape)] if compact else np.int64  # ids checked above: they fit
    return torch.from_numpy(ids.astype(wide)).view(positions, shape.moe_layers, shape.top_k)


def rollout_routes(turns: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """A rollout's routes from its turns' engine passes (one per model turn, in order), each
    [its prompt + its completion - 1, L, k]. Every position is taken from the pass that first
    computed it: a later turn re-prefills the earlier transcript (possibly under a newer version),
    but the tokens before it were sampled from the earlier passes' routing. None if any turn's pass
    did not capture routes (an engine without capture, or a prefix-cache hit that skipped positions)."""
    if not turns or any(t is None for t in turns):
        return None
    parts, covered = [], 0
    for t in turns:
        if t.shape[0] < covered:
            return None
        parts.append(t[covered:])
        covered = t.shape[0]
    return torch.cat(parts)
