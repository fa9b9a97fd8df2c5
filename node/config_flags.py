"""Command-line flags generated from a pydantic config, as prime-rl builds its CLI from its configs.

A field `shardcast_port: int = Field(8470, ge=1)` with a docstring under it becomes
`--shardcast-port`, typed, its docstring the `--help`, its default the field's (written once, on the
field). `Literal` fields become choices, `list[X]` fields repeatable flags, a bool field that
defaults to False a switch, one that defaults to True a `--no-...` switch. `Flag(...)` in a field's
`Annotated` metadata names the flag otherwise, groups it, or keeps it off the command line.
`config_from(Config, args)` builds the config back from the parsed flags: pydantic checks the
bounds, and a value out of them is an `InvalidFlag` naming the flag.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

C = TypeVar("C", bound=BaseModel)


class InvalidFlag(ValueError):
    """A command-line value the command's config refuses (out of bounds, the wrong type)."""


@dataclass(frozen=True)
class Flag:
    """How a config field appears on the command line (put it in the field's `Annotated[...]`)."""

    name: str | None = None
    """The flag (default: `--field-name`; a bool field that defaults to True: `--no-field-name`)."""
    metavar: str | None = None
    group: str | None = None
    """Title of the argument group the flag is listed under in `--help`."""
    cli: bool = True
    """False: the field is set by programs only (a Python object no flag can spell)."""


def flag_of(name: str, field: FieldInfo) -> Flag:
    return next((m for m in field.metadata if isinstance(m, Flag)), Flag())


def flag_name(name: str, field: FieldInfo) -> str:
    spelled = flag_of(name, field).name
    if spelled:
        return spelled
    prefix = "--no-" if _bare(field.annotation) is bool and field.default is True else "--"
    return prefix + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, config: type[BaseModel],
              exclude: tuple[str, ...] = ()) -> dict[str, argparse.Action]:
    """One flag per field of `config` (those in `exclude` and those marked `Flag(cli=False)` aside);
    returns each flag's action by field name (for choices only known at run time, such as the engines)."""
    groups: dict[str, Any] = {}
    actions: dict[str, argparse.Action] = {}
    for name, field in config.model_fields.items():
        flag = flag_of(name, field)
        if name in exclude or not flag.cli:
            continue
        where = parser if flag.group is None else groups.setdefault(flag.group, parser.add_argument_group(flag.group))
        actions[name] = where.add_argument(flag_name(name, field), dest=name, **_argparse_kwargs(field, flag))
    return actions


def config_from(config: type[C], args: argparse.Namespace, **values: Any) -> C:
    """`config` from the parsed flags (its fields' names are the flags' dests) and `values` on top."""
    given = {n: getattr(args, n) for n, f in config.model_fields.items() if flag_of(n, f).cli and hasattr(args, n)}
    given = {n: v for n, v in given.items() if v is not PydanticUndefined}
    try:
        return config.model_validate({**given, **values})
    except ValidationError as exc:
        fields = config.model_fields
        said = []
        for e in exc.errors(include_url=False):
            where = str(e["loc"][0]) if e["loc"] else ""
            named = flag_name(where, fields[where]) if where in fields else where
            said.append(f"{named}: {e['msg'].removeprefix('Value error, ')}" if named else e["msg"])
        raise InvalidFlag("; ".join(said)) from None


def _argparse_kwargs(field: FieldInfo, flag: Flag) -> dict[str, Any]:
    kind = _bare(field.annotation)
    default = None if field.default is PydanticUndefined else field.default
    if field.default_factory is not None:
        default = field.default_factory()
    text = " ".join((field.description or "").split())
    kwargs: dict[str, Any] = {"help": text.replace("%", "%%")}
    if flag.metavar or flag.name:  # a flag spelt otherwise than its field shows its own name
        kwargs["metavar"] = flag.metavar or flag.name.lstrip("-").upper().replace("-", "_")
    if field.is_required():
        kwargs["required"] = True
    if kind is bool:
        kwargs.pop("metavar", None)
        kwargs["action"] = "store_false" if default is True else "store_true"
        return kwargs
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        kwargs.update(choices=list(choices), type=type(choices[0]))
    elif typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        kwargs.update(action="append", type=_bare(item))
    elif kind in (int, float, str, Path):
        kwargs["type"] = kind
    else:
        raise TypeError(f"no flag for a field of type {field.annotation!r}: mark it Flag(cli=False)")
    kwargs["default"] = default
    if default not in (None, [], "") and "default" not in text.lower():
        kwargs["help"] += f" (default: {default})"
    return kwargs


def _bare(annotation: Any) -> Any:
    """`X` of `X | None` and of `Optional[X]`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation
