"""Environments written with the `verifiers` library (0.4, `verifiers.v1`) as a run's task.

A run names one as `verifiers:<id>` (a registered example, `REGISTERED`) or
`verifiers:<python.module>:<attr>`, where the attribute is a verifiers `Taskset` (played
single-turn), an `Env` with one seat (played over turns), or a zero-argument callable returning
either. `node.envs.get_env` hands every such name here, so each role loads this package (and
verifiers) only when its run asks for it. Loaded environments are cached per name: roles call
`get_env` per rollout.
"""

from __future__ import annotations

import importlib
from functools import lru_cache

from contrib.verifiers.errors import (UnsupportedVerifiersEnv, VerifiersEnvNotFound, VerifiersNotInstalled,
                                      VerifiersTaskError)
from node.envs.base import Environment

PREFIX = "verifiers:"
REGISTERED: dict[str, tuple[str, dict]] = {
    "digit-reverse": ("contrib.verifiers.examples:digit_reverse", {"max_new_tokens": 8}),
    "digit-reverse-feedback": ("contrib.verifiers.examples:reverse_with_feedback", {"max_new_tokens": 8}),
}
"""Short ids: target `module:attr` and the adapter's options (max_new_tokens: longest reply + 2)."""
INSTALL_HINT = "pip install 'primerl-node[verifiers]' (verifiers==0.4.0)"


def load_environment(spec: str, **options) -> Environment:
    """The environment for `spec` (the task name after `verifiers:`)."""
    if not options:
        return _cached(spec)
    return _load(spec, options)


@lru_cache(maxsize=32)
def _cached(spec: str) -> Environment:
    return _load(spec, {})


def _load(spec: str, options: dict) -> Environment:
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise VerifiersNotInstalled(f"task {PREFIX}{spec} needs the verifiers package: {INSTALL_HINT} ({exc})") from exc
    from contrib.verifiers.adapter import VerifiersEnvironment

    target, defaults = REGISTERED.get(spec, (spec, {}))
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise VerifiersEnvNotFound(f"task {PREFIX}{spec}: expected a registered id ({', '.join(sorted(REGISTERED))}) "
                                   "or <python.module>:<attr>")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise VerifiersEnvNotFound(f"task {PREFIX}{spec}: module {module_name!r} not found ({exc})") from exc
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise VerifiersEnvNotFound(f"task {PREFIX}{spec}: module {module_name!r} has no {attr!r}") from None
    if callable(obj) and not isinstance(obj, (vf.Taskset, vf.Env)):
        try:
            obj = obj()
        except TypeError as exc:
            raise UnsupportedVerifiersEnv(f"task {PREFIX}{spec}: {attr} is not a zero-argument factory ({exc})") from exc
    return VerifiersEnvironment(PREFIX + spec, obj, **{**defaults, **options})


__all__ = ["load_environment", "REGISTERED", "PREFIX", "VerifiersTaskError", "VerifiersNotInstalled",
           "VerifiersEnvNotFound", "UnsupportedVerifiersEnv"]
