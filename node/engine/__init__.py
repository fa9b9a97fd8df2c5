"""Inference engines. The built-in torch engine: KV cache, continuous batching, seeded sampling.

Names load on first use (PEP 562): `node.engine.registry` (engine names for `--engine`, which the
coordinator's command line also builds) must not pull torch into a process that runs no engine."""

from __future__ import annotations

import importlib

_HOMES = {"Engine": "engine", "Request": "core", "Completion": "core", "RequestTooLong": "core",
          "SamplingParams": "sampling"}

__all__ = ["Engine", "Request", "Completion", "SamplingParams", "RequestTooLong"]


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"node.engine.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'node.engine' has no attribute {name!r}")
