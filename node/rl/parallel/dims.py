"""How the world is split: data-parallel (FSDP) x context-parallel, with expert parallelism borrowed
from the data-parallel ranks (as torchtitan does: EP ranks see different tokens, so EP costs no extra
processes). Rank layout, outermost first: (dp // ep, ep, cp); world = dp * cp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from pydantic import BaseModel, Field, model_validator
from torch.distributed.device_mesh import DeviceMesh

from node.distributed.world import LayoutError, init_distributed, shutdown_distributed  # noqa: F401 (re-exported)


class ParallelDims(BaseModel):
    dp: int = Field(1, ge=1)
    """Data-parallel ranks (each sees different rows; parameters FSDP-sharded across them)."""
    ep: int = Field(1, ge=1)
    """Expert-parallel ranks, taken from the data-parallel ones; divides dp and num_experts."""
    cp: int = Field(1, ge=1)
    """Context-parallel ranks (each holds one slice of every sequence)."""
    fsdp: bool = True
    """Shard parameters, gradients and optimizer state with FSDP2 `fully_shard`."""
    bf16: bool | None = None
    """Mixed precision (FSDP2 `MixedPrecisionPolicy`): compute and all-gather in bf16, keep fp32
    master weights, gradients reduced in fp32 and AdamW states in fp32; published versions are
    bf16. Needs `fsdp`. None: on when the world runs on CUDA with fsdp (`mixed_precision`)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them."""

    @model_validator(mode="after")
    def _check(self) -> "ParallelDims":
        if self.dp % self.ep:
            raise LayoutError(f"ep={self.ep} must divide dp={self.dp}")
        if self.bf16 and not self.fsdp:
            raise LayoutError("bf16 mixed precision is FSDP2's policy: it needs fsdp")
        return self

    def check_model(self, cfg) -> None:
        """Raise `LayoutError` naming what does not divide: experts by ep. (Heads need not divide
        by cp: ring attention keeps every head of its sequence slice; a sequence that does not
        divide by cp is padded with loss-free positions.)"""
        if cfg.num_experts and cfg.num_experts % self.ep:
            raise LayoutError(f"ep={self.ep} must divide the model's num_experts={cfg.num_experts}")
        if self.ep > 1 and not cfg.num_experts:
            raise LayoutError(f"ep={self.ep} on a dense model (num_experts=0)")

    def mixed_precision(self, device_type: str) -> bool:
        """Whether the bf16 policy applies on this device type."""
        if self.bf16 is not None:
            return self.bf16
        return self.fsdp and device_type == "cuda"

    @property
    def world(self) -> int:
        return self.dp * self.cp


def coordinates(dims: ParallelDims, rank: int) -> tuple[int, int, int]:
    """(outer, ep_rank, cp_rank) of a global rank in the layout (dp // ep, ep, cp);
    its dp_rank is outer * ep + ep_rank."""
    outer, rest = divmod(rank, dims.ep * dims.cp)
    ep_rank, cp_rank = divmod(rest, dims.cp)
    return outer, ep_rank, cp_rank


@dataclass
class RankCoords:
    """Where a rank's share of a batch comes from (what `shard_batch` reads)."""

    dims: ParallelDims
    dp_rank: int
    cp_rank: int

    @classmethod
    def of(cls, dims: ParallelDims, rank: int) -> "RankCoords":
        outer, ep_rank, cp_rank = coordinates(dims, rank)
        return cls(dims, outer * dims.ep + ep_rank, cp_rank)


def _submesh(device: str, ranks: torch.Tensor, name: str) -> DeviceMesh:
    """A 1-D mesh over this rank's row of `ranks` ([groups, size]); every rank builds every group
    (process-group creation is collective), then keeps its own."""
    return DeviceMesh(device, ranks, mesh_dim_names=("rest", name))[name]


@dataclass
class ParallelGroups:
    """This rank's coordinates and the meshes/groups it belongs to."""

    dims: ParallelDims
    rank: int
    dp_rank: int
    ep_rank: int
    cp_rank: int
    world_mesh: DeviceMesh
    """All ranks: dense parameters are replicated (and FSDP-sharded) over every rank."""
    expert_mesh: DeviceMesh
    """Ranks holding the same experts (dp // ep * cp of them): expert parameters shard over these."""
    ep_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    expert_grid: DeviceMesh
    """(ep, expert_replicas): an expert tensor is split over ep, then FSDP-sharded over the
    replicas; checkpoints see it as one tensor of the one-process shape on this 2-D mesh."""

    @classmethod
    def build(cls, dims: ParallelDims, device: str = "cpu") -> "ParallelGroups":
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != dims.world:
            raise LayoutError(f"dp={dims.dp} x cp={dims.cp} needs {dims.world} processes, the world has {world}")
        grid = torch.arange(world).view(dims.dp // dims.ep, dims.ep, dims.cp)
        outer, ep_rank, cp_rank = coordinates(dims, rank)
        world_mesh = _submesh(device, grid.reshape(1, -1), "world")
        expert_grid = DeviceMesh(device, grid.permute(1, 0, 2).reshape(dims.ep, -1),
                                 mesh_dim_names=("ep", "expert_replicas"))
        cp_mesh = _submesh(device, grid.reshape(-1, dims.cp), "cp")
        return cls(dims, rank, outer * dims.ep + ep_rank, ep_rank, cp_rank, world_mesh,
                   expert_grid["expert_replicas"], expert_grid["ep"].get_group(), cp_mesh.get_group(), expert_grid)


def parse_layout(text: str, fsdp: bool = True, activation_checkpointing: bool = False) -> ParallelDims:
    """'dp2-ep2-cp2' -> ParallelDims(dp=2, ep=2, cp=2); omitted dims are 1."""
    sizes = {part[:2]: int(part[2:]) for part in text.split("-")}
    return ParallelDims(**sizes, fsdp=fsdp, activation_checkpointing=activation_checkpointing)
