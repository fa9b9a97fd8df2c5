"""Why a `verifiers:` task cannot be loaded (typed, so a launch fails with the reason)."""

from __future__ import annotations

from node.envs import UnknownTask


class VerifiersTaskError(UnknownTask):
    """A `verifiers:` task name that does not resolve to a usable environment."""


class VerifiersNotInstalled(VerifiersTaskError):
    """The `verifiers` package is not importable in this environment."""


class VerifiersEnvNotFound(VerifiersTaskError):
    """The module, attribute or registered id named by the task does not exist."""


class UnsupportedVerifiersEnv(VerifiersTaskError):
    """The object is not a verifiers Taskset/Env, or needs what cannot run here (judges, sandboxes,
    several seats, prompts outside the char alphabet)."""
