"""`primerl-node`: one program, every role. Each command lives with its concept and registers here.

A command module exposes `register(subparsers)`, which adds its sub-parser and sets
`func=<callable(args) -> int>`. Only the module of the command being run is imported.
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import importlib
import logging
import signal
import sys

# Command name -> (module that registers it, one-line summary). Only the module of the command
# being run is imported (libp2p and torch take seconds to import); `--help` lists the summaries.
COMMANDS: dict[str, tuple[str, str]] = {
    "sim": ("node.sim", "the whole network on this machine, one OS process per role"),
    "coordinator": ("node.join_cli", "run a coordinator (`coordinator launch --config run.toml`)"),
    "join": ("node.join_cli", "join a run as inference | trainer | validator | relay"),
    "keygen": ("protocol.cli", "create an Ed25519 node key; prints the node id (libp2p PeerID)"),
    "shardcast": ("shardcast.cli", "publish, serve, relay and fetch signed policy versions"),
    "model": ("node.model_cli", "a checkpoint's [model] table for run.toml, its weights hash pinned (`model pin DIR`)"),
    "verify": ("node.validator_cli", "verify rollout claims against a checkpoint; print signed verdicts"),
    "train-local": ("node.train_local", "synchronous RL in one process (engine + trainer) on a built-in task"),
}


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def _command_in(argv: list[str]) -> str | None:
    i = 0
    while i < len(argv):
        if argv[i] == "--log-level":
            i += 2
            continue
        if not argv[i].startswith("-"):
            return argv[i]
        i += 1
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primerl-node",
        description="Decentralized asynchronous RL for LLMs. Roles: coordinator, inference, trainer, validator, relay.",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = _command_in(sys.argv[1:] if argv is None else argv)
    wanted = {COMMANDS[chosen][0]} if chosen in COMMANDS else set()
    if argv is not None and chosen is None:  # programmatic callers get every command
        wanted = {module for module, _ in COMMANDS.values()}
    for module in dict.fromkeys(m for m, _ in COMMANDS.values()):
        if module in wanted:
            importlib.import_module(module).register(sub)
    for name, (_, summary) in COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None, **overrides) -> int:
    """`overrides`: attributes set on the parsed arguments (node/adversary.py passes `customize`)."""
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    for name, value in overrides.items():
        setattr(args, name, value)
    setup_logging(args.log_level)
    _stack_dumps_on_sigusr1()
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except _user_errors() as exc:  # bad input from the person at the keyboard: say what, not a traceback
        print(f"primerl-node {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _stack_dumps_on_sigusr1() -> None:
    """`kill -USR1 PID` prints every thread's stack to stderr (the sim asks before a SIGKILL)."""
    if not hasattr(signal, "SIGUSR1"):
        return
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (io.UnsupportedOperation, ValueError, AttributeError):
        pass  # stderr is not a real file (captured in a test): no dumps, nothing else changes


def _user_errors() -> tuple[type[Exception], ...]:
    from node.config_flags import InvalidFlag
    from node.envs import UnknownTask
    from node.envs.user import TaskMismatch
    from node.model import InvalidCheckpoint, InvalidModelConfig
    from node.model.errors import ModelLoadError
    from node.recipe import InvalidRecipe
    from node.engine.registry import EngineUnavailable
    from node.launch_guard import LaunchError
    from node.run_config import InvalidRunConfig
    from protocol.errors import ProtocolError

    return (UnknownTask, InvalidCheckpoint, InvalidModelConfig, ProtocolError, EngineUnavailable, InvalidRunConfig,
            InvalidRecipe, ModelLoadError, LaunchError, TaskMismatch, InvalidFlag)


if __name__ == "__main__":
    sys.exit(main())
