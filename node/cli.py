"""`primerl-node`: one program, every role. Each command lives with its concept and registers here.

A command module exposes `register(subparsers)`, which adds its sub-parser and sets
`func=<callable(args) -> int>`. Modules are imported only when the CLI starts.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# One line per command module; each owns its own arguments and help text.
COMMAND_MODULES = [
    "node.rl.train_local",
    "protocol.cli",
    "shardcast.cli",
    "node.validator_cli",
    "node.join_cli",
    "node.sim",
]


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primerl-node",
        description="Decentralized asynchronous RL for LLMs. Roles: coordinator, inference, trainer, validator, relay.",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except _user_errors() as exc:  # bad input from the person at the keyboard: say what, not a traceback
        print(f"primerl-node {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _user_errors() -> tuple[type[Exception], ...]:
    from node.envs import UnknownTask
    from node.model import InvalidCheckpoint, InvalidModelConfig
    from protocol.errors import ProtocolError

    return (UnknownTask, InvalidCheckpoint, InvalidModelConfig, ProtocolError)


if __name__ == "__main__":
    sys.exit(main())
