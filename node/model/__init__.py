"""The one causal-LM definition (Qwen3-MoE layout; dense Qwen3 and Llama too) and its checkpoints.

Names load on first use (PEP 562): `node.model.tokenizer`, which the tasks import, must not pull
torch into processes that never run a model (the coordinator: 2.5 s of its start-up under load)."""

from __future__ import annotations

import importlib

_HOMES = {"InvalidCheckpoint": "checkpoint", "load_checkpoint": "checkpoint", "save_checkpoint": "checkpoint",
          "InvalidModelConfig": "config", "ModelConfig": "config", "CausalLM": "qwen3_moe", "ModelOutput": "qwen3_moe",
          "CharTokenizer": "tokenizer"}

__all__ = ["CausalLM", "ModelOutput", "ModelConfig", "InvalidModelConfig", "InvalidCheckpoint",
           "load_checkpoint", "save_checkpoint", "CharTokenizer"]


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"node.model.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'node.model' has no attribute {name!r}")
