"""Distributed checkpoints (`torch.distributed.checkpoint`): every rank writes only its shards of
the weights and of AdamW's state, and reads back only the shards its layout needs.

Each tensor is saved as ONE tensor of the one-process shape: a dense parameter as its FSDP
DTensor over all ranks, an expert parameter as a DTensor over the 2-D (ep, expert_replicas) mesh
with Shard(0) on both (experts split over ep, then FSDP-sharded), replicated tensors plainly. So
the checkpoint does not depend on the layout that wrote it: DCP reshards at load time for any
dp/ep/cp, and one process (`Trainer.load`, `no_dist`) reads it whole. Beside the shards, rank 0
writes `trainer.json` (step, trainer config, model config, layout) and `config.json` last, each
save into a fresh `dcp-<step>` directory, so a crash mid-save leaves the previous one in force.
"""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard

from node.model.config import ModelConfig
from node.rl.parallel.apply import is_expert_param
from node.rl.parallel.state import MOMENTS, global_shape

TRAINER_JSON = "trainer.json"


class CheckpointMismatch(ValueError):
    """A checkpoint written for another model (or unreadable): names the first difference."""


def _view(groups, name: str, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t` (shaped like parameter `p`) as the one-process-shaped tensor the checkpoint stores,
    sharing t's storage (so a load writes straight into it)."""
    if not (is_expert_param(name) and groups.dims.ep > 1):
        return t
    local = t.to_local() if isinstance(t, DTensor) else t
    placements = (Shard(0), Shard(0)) if isinstance(t, DTensor) else (Shard(0), Replicate())
    shape = global_shape(groups, name, p)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, groups.expert_grid, placements, run_check=False, shape=shape, stride=stride)


def _state(trainer, create: bool) -> dict[str, torch.Tensor]:
    """Name -> tensor views of the weights and AdamW state; with `create`, parameters without
    AdamW state get zero states first (a load fills them; `step` 0 means none)."""
    out = {}
    for name, p in trainer.model.named_parameters():
        out[f"model/{name}"] = _view(trainer.groups, name, p, p.data if not isinstance(p, DTensor) else p)
        state = trainer.optimizer.state.get(p)
        if not state and create:
            state = trainer.optimizer.state[p] = {"step": torch.zeros(()), **{k: torch.zeros_like(p) for k in MOMENTS}}
        for k in MOMENTS:
            out[f"optim/{name}/{k}"] = _view(trainer.groups, name, p, state[k] if state else torch.zeros_like(p))
        step = state["step"] if state else torch.zeros(())
        out[f"optim/{name}/step"] = step if torch.is_tensor(step) else torch.tensor(float(step))
    return out


def save(trainer, directory: str | Path) -> Path:
    """Every rank writes its shards (collective); rank 0 then points `trainer.json` at them."""
    directory = Path(directory)
    shards = directory / f"dcp-{trainer.step}"
    if dist.get_rank() == 0 and shards.exists():
        shutil.rmtree(shards)
    dist.barrier()
    dcp.save(_state(trainer, create=False), checkpoint_id=str(shards))
    if dist.get_rank() == 0:
        meta = {"step": trainer.step, "config": asdict(trainer.cfg), "distributed_checkpoint": shards.name,
                "model": trainer.model.config.model_dump(), "layout": trainer.groups.dims.model_dump()}
        (directory / "config.json").write_text(json.dumps(trainer.model.config.to_hf_dict(), indent=2))
        tmp = directory / (TRAINER_JSON + ".tmp")
        tmp.write_text(json.dumps(meta))
        tmp.replace(directory / TRAINER_JSON)
        for old in directory.glob("dcp-*"):
            if old != shards:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return directory


def read_meta(directory: str | Path) -> dict:
    try:
        return json.loads((Path(directory) / TRAINER_JSON).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointMismatch(f"no readable {TRAINER_JSON} in {directory}: {exc}") from exc


def check_model(meta: dict, cfg: ModelConfig, where: str) -> None:
    """Raise `CheckpointMismatch` naming each model field that differs."""
    saved = meta.get("model", {})
    diff = [f"{k}: checkpoint {saved.get(k)!r}, model {v!r}" for k, v in cfg.model_dump().items() if saved.get(k) != v]
    if diff:
        raise CheckpointMismatch(f"checkpoint {where} is for another model: " + "; ".join(diff))


def load(trainer, directory: str | Path) -> None:
    """Fill this rank's shards of weights and AdamW state from a checkpoint written under any
    layout (collective); `trainer.step` becomes the checkpoint's."""
    meta = read_meta(directory)
    check_model(meta, trainer.model.config, str(directory))
    state = _state(trainer, create=True)
    dcp.load(state, checkpoint_id=str(Path(directory) / meta["distributed_checkpoint"]))
    for name, p in trainer.model.named_parameters():
        s = trainer.optimizer.state[p]
        s["step"] = state[f"optim/{name}/step"].detach().float().cpu().reshape(())
        if float(s["step"]) == 0:
            del trainer.optimizer.state[p]
    trainer.step = int(meta["step"])


def load_whole(model: torch.nn.Module, directory: str | Path, optimizer: bool = True) -> tuple[dict, dict]:
    """One process: the checkpoint's weights into `model` (whole) and, with `optimizer`, its AdamW
    state by parameter name ({exp_avg, exp_avg_sq, step}, parameters with step 0 left out)."""
    meta = read_meta(directory)
    check_model(meta, model.config, str(directory))
    params = dict(model.named_parameters())
    state = {f"model/{n}": p.data for n, p in params.items()}
    if optimizer:
        for n, p in params.items():
            state |= {f"optim/{n}/{k}": torch.zeros_like(p.data) for k in MOMENTS}
            state[f"optim/{n}/step"] = torch.zeros(())
    with warnings.catch_warnings():  # one process by intent (no_dist): torch warns that it assumes so all the same
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=str(Path(directory) / meta["distributed_checkpoint"]), no_dist=True)
    opt = {}
    if optimizer:
        for n in params:
            if float(state[f"optim/{n}/step"]) > 0:
                opt[n] = {k: state[f"optim/{n}/{k}"] for k in (*MOMENTS, "step")}
    return meta, opt
