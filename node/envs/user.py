"""User tasks: a native `Environment` from the user's own module, named `module:attr` on any role's
`--task` (or run.toml's `task`), pinned by a hash of its source file.

`coordinator launch` writes the task into the signed spec as `module:attr@<sha256 of the module's
source, 16 hex>` (`task_identity`); every node that loads the spec's environment recomputes the
hash of the module it would import and refuses to run another version (`TaskMismatch`), so the
trainer, the validator and every inference node grade the same code.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect

from node.envs.base import Environment

HASH_HEX = 16
"""Hex digits of the source hash kept in the task identity."""


class TaskMismatch(ValueError):
    """The local module is not the source the run's spec pinned (or cannot be loaded)."""


IMPORT_HINT = "every role imports it: put the directory holding the module on PYTHONPATH"


def is_user_task(name: str) -> bool:
    """`module:attr[@hash]`, as opposed to a built-in name or a registered family (`verifiers:<id>`)."""
    from node.envs import TASK_FAMILIES

    family, sep, _ = name.partition(":")
    return bool(sep) and family not in TASK_FAMILIES


def _split(name: str) -> tuple[str, str, str | None]:
    ref, _, digest = name.partition("@")
    module, _, attr = ref.partition(":")
    if not module or not attr:
        raise TaskMismatch(f"task {name!r}: expected module:attr[@hash]")
    return module, attr, digest or None


def source_hash(module_name: str) -> str:
    try:
        module = importlib.import_module(module_name)
        path = inspect.getsourcefile(module)
    except (ImportError, TypeError) as exc:
        raise TaskMismatch(f"task module {module_name!r} cannot be loaded: {exc} ({IMPORT_HINT})") from None
    if path is None:
        raise TaskMismatch(f"task module {module_name!r} has no source file to pin")
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:HASH_HEX]


def task_identity(name: str) -> str:
    """`module:attr` -> `module:attr@<source hash>` (an identity that already has one is checked)."""
    module, attr, digest = _split(name)
    here = source_hash(module)
    if digest is not None and digest != here:
        raise TaskMismatch(f"task {module}:{attr}: local source hash {here}, the run pins {digest}")
    return f"{module}:{attr}@{here}"


def load_user_env(name: str, **kwargs) -> Environment:
    """The environment `module:attr[@hash]` names: an `Environment` instance, or a class or factory
    returning one. With a hash, the local module's source must hash to it."""
    module, attr, digest = _split(name)
    if digest is not None:
        task_identity(name)
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        hint = f" ({IMPORT_HINT})" if isinstance(exc, ImportError) else ""
        raise TaskMismatch(f"task {module}:{attr} cannot be loaded: {exc}{hint}") from None
    env = obj if isinstance(obj, Environment) else obj(**kwargs) if callable(obj) else None
    if not isinstance(env, Environment):
        raise TaskMismatch(f"task {module}:{attr} is not an Environment (nor a class or factory of one)")
    return env
