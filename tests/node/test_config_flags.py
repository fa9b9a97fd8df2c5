"""The commands' flags come from their config fields: the docstring is the help, the default the field's."""

from __future__ import annotations

import argparse

import pytest

from node.cli import build_parser, main
from node.config_flags import InvalidFlag, add_flags, config_from, flag_name
from node.join_config import JoinConfig, LaunchConfig

CONFIGS = {("join",): JoinConfig, ("coordinator", "launch"): LaunchConfig}


def _subparser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser([])
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


@pytest.mark.parametrize("path", list(CONFIGS))
def test_every_flag_is_a_documented_field_whose_docstring_is_its_help(path):
    config, parser = CONFIGS[path], _subparser(path)
    by_dest = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    assert set(by_dest) == set(config.model_fields)
    for name, field in config.model_fields.items():
        assert field.description, f"{config.__name__}.{name} has no docstring"
        action = by_dest[name]
        assert action.option_strings == [flag_name(name, field)]
        assert " ".join(field.description.split()) in action.help
        if not field.is_required() and field.default_factory is None:
            assert action.default == field.default, name


def test_flags_not_given_leave_the_fields_defaults_and_given_ones_are_typed():
    argv = ["join", "--role", "trainer", "--bootstrap", "/ip4/127.0.0.1/tcp/1", "--dp", "2", "--no-fsdp"]
    args = build_parser(argv).parse_args(argv)
    cfg = config_from(JoinConfig, args)
    assert cfg == JoinConfig(role="trainer", bootstrap="/ip4/127.0.0.1/tcp/1", dp=2, fsdp=False)
    assert cfg.shardcast_port == JoinConfig.model_fields["shardcast_port"].default == 8470


def test_a_value_out_of_bounds_is_a_typed_error_naming_the_flag(capsys):
    with pytest.raises(InvalidFlag, match="^--ep: .*greater than or equal to 1"):
        config_from(JoinConfig, argparse.Namespace(role="inference", bootstrap="x", ep=0))
    assert main(["join", "--role", "trainer", "--bootstrap", "/ip4/127.0.0.1/tcp/1", "--cp", "0"]) == 2
    assert "primerl-node join: error: --cp:" in capsys.readouterr().err


def test_a_field_no_flag_can_spell_is_refused_when_the_flags_are_made():
    from pydantic import BaseModel

    class Odd(BaseModel):
        where: dict = {}

    with pytest.raises(TypeError, match="Flag\\(cli=False\\)"):
        add_flags(argparse.ArgumentParser(), Odd)
