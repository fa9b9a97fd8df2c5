"""Environments: the interface, the built-in tasks, and the rollout driver."""

from __future__ import annotations

from node.envs.arithmetic import Addition, Reverse
from node.envs.base import Environment, Task
from node.envs.calculator import Calculator
from node.envs.coding import Coding

TASKS: dict[str, type[Environment]] = {"reverse": Reverse, "addition": Addition, "calculator": Calculator, "coding": Coding}


class UnknownTask(ValueError):
    """A task name with no registered environment."""


def get_env(name: str, **kwargs) -> Environment:
    if name.startswith("verifiers:"):  # contrib is imported only when a run asks for it
        from contrib.verifiers import load_environment

        return load_environment(name.removeprefix("verifiers:"), **kwargs)
    if ":" in name:  # a native Environment from the user's module, `module:attr[@source hash]`
        from node.envs.user import load_user_env

        return load_user_env(name, **kwargs)
    try:
        cls = TASKS[name]
    except KeyError:
        raise UnknownTask(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None
    return cls(**kwargs)


__all__ = ["Environment", "Task", "get_env", "UnknownTask", "TASKS"]
