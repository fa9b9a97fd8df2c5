"""`coordinator launch` and `join` plumbing: run.toml validation, the spec handed out at bootstrap,
clean shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from cli_runs import cli, run_at_once
from node.spec_handout import fetch_spec
from node.recipe import DEFAULT, InvalidRecipe, Recipe
from node.run_config import InvalidRunConfig, RunConfig, to_toml
from node.sim_procs import free_port
from protocol.identity import NodeKey
from protocol.messages import RunSpec


TRAINER, VALIDATOR = NodeKey.from_seed(b"t" * 32).peer_id, NodeKey.from_seed(b"v" * 32).peer_id


def write_config(path, **over) -> None:
    values = {"run_id": "t1", "task": "reverse", "batch_groups": 4, "group_size": 2, "trainer": TRAINER,
              "validators": [VALIDATOR],
              "listen": f"/ip4/127.0.0.1/tcp/{free_port()}", "status_port": 0, "recipe": {"steps": 3}} | over
    path.write_text(to_toml(values))


def test_run_toml_round_trips_and_bad_keys_or_tasks_are_refused(tmp_path):
    write_config(tmp_path / "ok.toml")
    spec = RunConfig.load(tmp_path / "ok.toml").run_spec("12D3KooWcoordinator")
    assert spec.batch_groups == 4 and spec.group_size == 2 and spec.recipe == {"steps": 3}
    write_config(tmp_path / "typo.toml", batch_group=4)
    with pytest.raises(InvalidRunConfig, match="batch_group"):
        RunConfig.load(tmp_path / "typo.toml")
    write_config(tmp_path / "task.toml", task="no-such-task")
    with pytest.raises(Exception, match="no-such-task"):
        RunConfig.load(tmp_path / "task.toml")


def test_a_misspelt_or_out_of_bounds_recipe_key_is_refused_at_launch_with_its_name(tmp_path):
    write_config(tmp_path / "lrr.toml", recipe={"steps": 3, "lrr": 1e-3})
    with pytest.raises(InvalidRunConfig, match="recipe.lrr"):
        RunConfig.load(tmp_path / "lrr.toml")
    write_config(tmp_path / "neg.toml", recipe={"lr": -1.0})
    with pytest.raises(InvalidRunConfig, match="recipe.lr"):
        RunConfig.load(tmp_path / "neg.toml")
    # `primerl-node coordinator launch` says so in one line and exits 2 (no traceback)
    out = subprocess.run([sys.executable, "-m", "node.cli", "coordinator", "launch", "--config",
                          str(tmp_path / "lrr.toml"), "--state", str(tmp_path / "state")],
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 2 and "recipe.lrr" in out.stderr and "Traceback" not in out.stderr


def test_run_toml_errors_read_as_sentences_and_a_top_level_key_under_a_table_is_pointed_out(tmp_path):
    # the walk-through: a run.toml without `trainer` said "run.toml: : Value error, `trainer` is required";
    # `trainer = ...` appended at the end of the documented run.toml lands in [recipe] (TOML) and said
    # "recipe.trainer: Extra inputs are not permitted"
    write_config(tmp_path / "no-trainer.toml", trainer=None)
    with pytest.raises(InvalidRunConfig) as caught:
        RunConfig.load(tmp_path / "no-trainer.toml")
    assert str(caught.value).startswith(f"{tmp_path / 'no-trainer.toml'}: `trainer` is required"), caught.value
    path = tmp_path / "appended.toml"
    write_config(path, trainer=None)
    path.write_text(path.read_text() + f'trainer = "{TRAINER}"\n')
    with pytest.raises(InvalidRunConfig, match=r"recipe.trainer: unknown key in \[recipe\]; `trainer` is a top-level key"):
        RunConfig.load(path)
    write_config(tmp_path / "typo.toml", batch_group=4)
    with pytest.raises(InvalidRunConfig, match="batch_group: unknown key$"):
        RunConfig.load(tmp_path / "typo.toml")


def test_the_recipe_travels_as_the_keys_set_and_reads_back_typed_with_defaults(tmp_path):
    write_config(tmp_path / "ok.toml", recipe={"steps": 3, "router_replay": False, "lr": 0.01})
    spec = RunConfig.load(tmp_path / "ok.toml").run_spec("12D3KooWcoordinator")
    assert spec.recipe == {"steps": 3, "router_replay": 0, "lr": 0.01}  # only what the operator set, plain values
    r = Recipe.of(spec)
    assert (r.steps, r.router_replay, r.lr, r.hidden) == (3, False, 0.01, DEFAULT.hidden)
    assert Recipe.of(spec.model_copy(update={"recipe": {}})) == DEFAULT
    with pytest.raises(InvalidRecipe, match="recipe.nope"):  # a node refuses a key it does not know too
        Recipe.of(spec.model_copy(update={"recipe": {"nope": 1}}))


def test_joiner_gets_the_run_spec_from_the_bootstrap_coordinator_which_stops_cleanly(tmp_path):
    write_config(tmp_path / "run.toml")
    addr = tmp_path / "addr"
    proc = subprocess.Popen([sys.executable, "-m", "node.cli", "coordinator", "launch", "--config",
                             str(tmp_path / "run.toml"), "--state", str(tmp_path / "state"), "--addr-file", str(addr)],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        end = time.time() + 300  # a hang guard: an exit ends the wait at once
        while not addr.exists() and time.time() < end and proc.poll() is None:
            time.sleep(0.1)
        bootstrap = addr.read_text().splitlines()[0]
        spec = asyncio.run(fetch_spec(bootstrap))
        assert spec == RunSpec.model_validate_json((tmp_path / "state" / "spec.json").read_bytes())
        assert spec.coordinator == bootstrap.rsplit("/p2p/", 1)[1]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_missing_malformed_or_other_coordinators_spec_is_one_line_and_exit_2(tmp_path):
    # the walk-through: a --spec path that does not exist, or a file that is not a spec, ended in a traceback
    ours, other = NodeKey.from_seed(b"c" * 32).peer_id, NodeKey.from_seed(b"d" * 32).peer_id
    (tmp_path / "other.json").write_text(RunSpec(run_id="t1", coordinator=other, trainer=TRAINER).model_dump_json())
    (tmp_path / "junk.json").write_text('{"bad": 1}')
    bootstrap = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{ours}"
    cases = (("missing.json", "No such file"), ("junk.json", "is not a run spec"),
             ("other.json", f"is the spec of coordinator {other}"))
    outs = run_at_once([cli("join", "--role", "inference", "--bootstrap", bootstrap, "--spec", str(tmp_path / spec),
                            "--workdir", str(tmp_path / f"inf-{spec}")) for spec, _ in cases])
    for (_, says), out in zip(cases, outs):
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_trainer_only_flags_are_refused_on_other_roles_before_anything_starts():
    from node.cli import main

    for flag in (["--activation-checkpointing"], ["--dp", "2"], ["--master-float32"]):
        with pytest.raises(SystemExit, match="apply to --role trainer only"):
            main(["join", "--role", "inference", "--bootstrap", "/ip4/127.0.0.1/tcp/1", *flag])


def test_an_inference_node_whose_fp8_differs_from_the_run_spec_is_refused_at_join(tmp_path, capsys):
    from node.cli import main
    from protocol.identity import NodeKey
    from protocol.messages import RunSpec
    from protocol.model_spec import ModelSpec

    coord = NodeKey.generate().peer_id
    spec = RunSpec(run_id="fp8-run", coordinator=coord, environment="reverse", model=ModelSpec(fp8="experts"))
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    argv = ["join", "--role", "inference", "--spec", str(tmp_path / "spec.json"), "--bootstrap",
            f"/ip4/127.0.0.1/tcp/1/p2p/{coord}", "--workdir", str(tmp_path / "node")]
    assert main([*argv, "--fp8", "off"]) == 2  # before any network: the validator would recompute in FP8
    err = capsys.readouterr().err
    assert "--fp8 off but this run serves fp8 experts" in err and "drop --fp8" in err
    assert main([*argv, "--fp8", "all"]) == 2
    with pytest.raises(SystemExit, match="--fp8 applies to --role inference only"):  # the validator reads the spec
        main(["join", "--role", "validator", "--bootstrap", "/ip4/127.0.0.1/tcp/1", "--fp8", "experts"])


def test_a_checkpoint_run_has_no_warm_up_and_one_asked_of_it_is_refused_at_launch_and_at_join(tmp_path):
    # a warm-up copies the model to the CPU and trains it in one process: seconds for tiny-moe, a 61 GB
    # copy for Qwen3-30B-A3B; the default of 0.25 applied to every source before
    write_config(tmp_path / "tiny.toml")
    tiny = RunConfig.load(tmp_path / "tiny.toml").run_spec("12D3KooWcoordinator")
    assert Recipe.of(tiny).warmup_target == DEFAULT.warmup_target > 0
    write_config(tmp_path / "ckpt.toml", model=str(tmp_path))
    ckpt = RunConfig.load(tmp_path / "ckpt.toml").run_spec("12D3KooWcoordinator")
    assert "warmup_target" not in ckpt.recipe and Recipe.of(ckpt).warmup_target == 0.0
    assert Recipe.of(ckpt).steps == 3  # the rest of the recipe as set
    write_config(tmp_path / "zero.toml", model=str(tmp_path), recipe={"warmup_target": 0.0})
    assert Recipe.of(RunConfig.load(tmp_path / "zero.toml").run_spec("12D3KooWcoordinator")).warmup_target == 0.0
    write_config(tmp_path / "warm.toml", model=str(tmp_path), recipe={"warmup_target": 0.5})
    with pytest.raises(InvalidRunConfig, match="recipe.warmup_target = 0.5: the supervised warm-up is for tiny-moe"):
        RunConfig.load(tmp_path / "warm.toml")
    with pytest.raises(InvalidRecipe, match="starts from its own weights"):  # a spec signed elsewhere, at join
        Recipe.of(ckpt.model_copy(update={"recipe": {"warmup_target": 0.5}}))
    warm_tiny = tiny.model_copy(update={"recipe": {"warmup_target": 0.5}})
    assert Recipe.of(warm_tiny).warmup_target == 0.5
