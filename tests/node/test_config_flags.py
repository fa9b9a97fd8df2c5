"""The commands' flags come from their config fields: the docstring is the help, the default the field's."""

from __future__ import annotations

import argparse

import pytest

from node.cli import build_parser, main
from node.config_flags import InvalidFlag, add_flags, config_from, flag_name, flag_of
from node.join_config import JoinConfig, LaunchConfig
from node.sim_config import SimConfig, SimFlags
from node.train_local import LocalRunConfig, TrainLocalFlags

CONFIGS = {("join",): JoinConfig, ("coordinator", "launch"): LaunchConfig, ("train-local",): TrainLocalFlags,
           ("sim",): SimFlags}


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
    assert set(by_dest) == {n for n, f in config.model_fields.items() if flag_of(n, f).cli}
    for name in set(config.model_fields) - set(by_dest):
        assert name not in by_dest
    for name, field in config.model_fields.items():
        if name not in by_dest:
            continue
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


def test_train_local_takes_the_tiny_defaults_from_the_recipe_and_a_pretrained_models_from_its_profile(tmp_path):
    from node.recipe import DEFAULT
    from node.run_config import RunConfig
    from node.train_local import PRETRAINED_DEFAULTS

    cfg = LocalRunConfig()
    assert (cfg.lr, cfg.updates_per_batch, cfg.minibatches, cfg.warmup_target, cfg.steps) == \
        (DEFAULT.lr, DEFAULT.updates_per_batch, DEFAULT.minibatches, DEFAULT.warmup_target, DEFAULT.steps)
    assert (cfg.prompts, cfg.samples) == (RunConfig.model_fields["batch_groups"].default,
                                          RunConfig.model_fields["group_size"].default)
    assert cfg.tiny() == DEFAULT.tiny_shape() and cfg.trainer.decay_steps == cfg.steps
    flags = TrainLocalFlags(out=tmp_path, model="smollm2-135m-instruct")
    assert all(getattr(flags, name) is None for name in PRETRAINED_DEFAULTS)  # the command fills them by model
    with pytest.raises(ValueError, match="hidden"):
        LocalRunConfig(hidden=4)  # the tiny shape's bounds are TinyMoE's, as in a run's recipe


def test_the_sims_flags_are_run_sims_config_with_the_run_defaults_written_once():
    from node.run_config import RunConfig

    run = RunConfig.model_fields
    cfg = SimConfig()
    assert (cfg.batch_groups, cfg.group_size, cfg.max_off_policy_steps) == \
        (run["batch_groups"].default, run["group_size"].default, run["max_off_policy_steps"].default)
    assert set(SimConfig.model_fields) <= set(SimFlags.model_fields)
    with pytest.raises(ValueError, match="inference_nodes"):
        SimConfig(inference_nodes=0)
    with pytest.raises(ValueError, match="fp8"):
        SimConfig(fp8="half")
