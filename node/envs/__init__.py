"""Environments: the interface, the built-in tasks, and the rollout driver."""

from __future__ import annotations

from node.envs.arithmetic import Addition, Reverse
from node.envs.base import Environment, Task
from node.envs.calculator import Calculator
from node.envs.coding import Coding
from node.envs.text_tasks import Arithmetic, LongReverseText, ReverseText
from node.plugins import resolve

TASKS: dict[str, type[Environment]] = {"reverse": Reverse, "addition": Addition, "calculator": Calculator, "coding": Coding,
                                     "reverse-text": ReverseText, "reverse-text-long": LongReverseText,
                                     "arithmetic": Arithmetic}
"""The built-in tasks (`reverse-text` and `arithmetic` are for pretrained models with real tokenizers)."""
DEFAULT_TASK = "reverse"
"""The task of a run, a sim and train-local that name none."""
TASK_FAMILIES: dict[str, str] = {"verifiers": "contrib.verifiers:load_environment"}
"""`<family>:<id>` task names -> the import path of the family's loader `(id, **kwargs) -> Environment`,
imported only when a run names such a task (`verifiers:<id>`: contrib/verifiers, `pip install -e '.[verifiers]'`)."""


class UnknownTask(ValueError):
    """A task name with no registered environment."""


def get_env(name: str, **kwargs) -> Environment:
    family, sep, rest = name.partition(":")
    if sep and family in TASK_FAMILIES:
        return resolve(TASK_FAMILIES[family])(rest, **kwargs)
    if sep:  # a native Environment from the user's module, `module:attr[@source hash]`
        from node.envs.user import load_user_env

        return load_user_env(name, **kwargs)
    try:
        cls = TASKS[name]
    except KeyError:
        raise UnknownTask(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}, or "
                          f"{' | '.join(f'{f}:<id>' for f in TASK_FAMILIES)}") from None
    return cls(**kwargs)


__all__ = ["Environment", "Task", "get_env", "UnknownTask", "TASKS", "TASK_FAMILIES", "DEFAULT_TASK"]
