"""Checkpoints as safetensors + config.json, with Hugging Face parameter names on disk.

In memory, experts are stacked (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]); on disk each expert has its own `mlp.experts.{e}.{gate,up,down}_proj.weight`, the
layout Qwen3-MoE checkpoints ship in and that `transformers` and vLLM load.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from node.model.config import InvalidModelConfig, ModelConfig
from node.model.qwen3_moe import CausalLM

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class InvalidCheckpoint(ValueError):
    """A checkpoint that is missing, unreadable, or does not fit the model it claims."""


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


def hf_to_internal(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Stack per-expert HF tensors into the in-memory layout; other names pass through."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in sd.items():
        m = _PER_EXPERT.match(name)
        if m:
            prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
            experts.setdefault(prefix, {}).setdefault(e, {})[kind] = t
        else:
            out[name] = t
    for prefix, by_e in experts.items():
        if sorted(by_e) != list(range(cfg.num_experts)):
            raise InvalidCheckpoint(f"{prefix}: expected experts 0..{cfg.num_experts - 1}, found {sorted(by_e)}")
        try:
            out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([by_e[e]["gate_proj"], by_e[e]["up_proj"]]) for e in range(cfg.num_experts)])
            out[f"{prefix}.down_proj"] = torch.stack([by_e[e]["down_proj"] for e in range(cfg.num_experts)])
        except (KeyError, RuntimeError) as exc:
            raise InvalidCheckpoint(f"{prefix}: incomplete or mis-shaped expert weights ({exc})") from exc
    if cfg.tie_word_embeddings and "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def load_hf_state_dict(model: CausalLM, sd: dict[str, torch.Tensor]) -> None:
    """Copy HF-named weights into `model` in place; every parameter must be present with its shape."""
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
        for name, p in own.items():
            p.copy_(internal[name])


def save_checkpoint(model: CausalLM, directory: str | Path, metadata: dict[str, str] | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    import json

    (directory / CONFIG).write_text(json.dumps(model.config.to_hf_dict(), indent=2))
    save_file(state_dict_to_hf(model), str(directory / WEIGHTS), metadata=metadata or {"format": "pt"})
    return directory


def load_checkpoint(directory: str | Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    directory = Path(directory)
    try:
        cfg = ModelConfig.from_file(directory / CONFIG)
    except InvalidModelConfig as exc:
        raise InvalidCheckpoint(str(exc)) from exc
    try:
        sd = load_file(str(directory / WEIGHTS))
    except (OSError, SafetensorError) as exc:
        raise InvalidCheckpoint(f"cannot read weights in {directory}: {exc}") from exc
    model = CausalLM(cfg)
    load_hf_state_dict(model, sd)
    return model.to(dtype)
