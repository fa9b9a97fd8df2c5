"""Optional parts by import path: "module:attribute" strings resolved only when a run asks for them.

The registries (`node/engine/registry.py` ENGINES, `node/envs` TASK_FAMILIES) name their optional
parts (contrib/vllm, contrib/verifiers) this way, so the core imports nothing from `contrib` and a
missing optional dependency costs nothing until it is used (tests/test_import_rules.py).
"""

from __future__ import annotations

import importlib


def resolve(path: str):
    """The attribute `path` ("package.module:attribute") names, importing its module now."""
    module, sep, attr = path.partition(":")
    if not sep or not attr:
        raise ValueError(f"import path {path!r} is not 'module:attribute'")
    return getattr(importlib.import_module(module), attr)
