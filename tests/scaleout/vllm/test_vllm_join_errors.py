"""`join --role inference --engine vllm` refuses to start, with one line saying why, when the run
does not accept vLLM rollouts or there is no usable vLLM interpreter; it never reaches the network.
Needs no vLLM (a valid interpreter is exercised by test_vllm_sim.py)."""

from __future__ import annotations

import sys

import pytest

from node.cli import main
from protocol.messages import RunSpec

COORDINATOR = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
BOOTSTRAP = f"/ip4/127.0.0.1/tcp/9/p2p/{COORDINATOR}"  # the spec names this coordinator: join checks they agree


def _join(tmp_path, engines, capfd) -> tuple[int, str]:
    spec = tmp_path / "spec.json"
    spec.write_text(RunSpec(run_id="r", coordinator=COORDINATOR, environment="reverse", engines=engines).model_dump_json())
    rc = main(["join", "--role", "inference", "--engine", "vllm", "--spec", str(spec), "--bootstrap", BOOTSTRAP,
               "--workdir", str(tmp_path / "node")])
    return rc, capfd.readouterr().err


def test_a_run_that_does_not_accept_vllm_is_refused_at_start(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("PRIMERL_VLLM_PYTHON", sys.executable)
    rc, err = _join(tmp_path, ("builtin",), capfd)
    assert rc == 2 and "does not accept vllm rollouts" in err


@pytest.mark.parametrize("python, says", [(None, "PRIMERL_VLLM_PYTHON is not set"),
                                          ("/nonexistent/python", "is not an executable file"),
                                          (sys.executable, "has no `vllm` package")])
def test_a_missing_or_invalid_vllm_interpreter_is_refused_at_start(tmp_path, capfd, monkeypatch, python, says):
    if python is None:
        monkeypatch.delenv("PRIMERL_VLLM_PYTHON", raising=False)
    else:
        monkeypatch.setenv("PRIMERL_VLLM_PYTHON", python)
    rc, err = _join(tmp_path, ("builtin", "vllm"), capfd)
    assert rc == 2 and says in err, err
    assert not (tmp_path / "node" / "vllm").exists()  # nothing was started


def _fake_vllm_python(tmp_path) -> str:
    """An interpreter on whose path a package named `vllm` exists (enough for the start-up check)."""
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text("")
    script = tmp_path / "python"
    script.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "site"} exec {sys.executable} "$@"\n')
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize("option, says", [("nonsense", "expected KEY=VALUE"), ("model=/x", "expected KEY=VALUE"),
                                          ("no_such_field=1", "expected KEY=VALUE"),
                                          ("data_parallel=zero", "data_parallel"),
                                          # the spec's: a bf16 run's validator judged fp8 rollouts by bf16 bounds
                                          ("quantization=fp8", "the run's spec sets quantization (model.fp8"),
                                          ("dtype=bfloat16", "the run's spec sets dtype (model.dtype: dtype float32"),
                                          ("enforce_eager=false", "skip the hooks that capture")])
def test_a_bad_vllm_setting_is_refused_at_start(tmp_path, capfd, monkeypatch, option, says):
    monkeypatch.setenv("PRIMERL_VLLM_PYTHON", _fake_vllm_python(tmp_path))
    spec = tmp_path / "spec.json"
    spec.write_text(RunSpec(run_id="r", coordinator=COORDINATOR, environment="reverse", engines=("builtin", "vllm"))
                    .model_dump_json())
    rc = main(["join", "--role", "inference", "--engine", "vllm", "--vllm", option, "--spec", str(spec),
               "--bootstrap", BOOTSTRAP, "--workdir", str(tmp_path / "node")])
    err = capfd.readouterr().err
    assert rc == 2 and says in err, err


def test_vllm_settings_from_join_are_typed_and_override_the_nodes_defaults(tmp_path, monkeypatch):
    from node.roles.inference import InferenceNode
    from protocol.identity import NodeKey

    monkeypatch.setenv("PRIMERL_VLLM_PYTHON", _fake_vllm_python(tmp_path))
    spec = RunSpec(run_id="r", coordinator=COORDINATOR, environment="reverse", engines=("builtin", "vllm"), group_size=4)
    node = InferenceNode(NodeKey.generate(), spec, BOOTSTRAP, tmp_path / "node", engine="vllm",
                         vllm=["data_parallel=2", "expert_parallel=true", "max_num_seqs=64"])
    assert node.engine_settings["data_parallel"] == 2 and node.engine_settings["expert_parallel"] is True
    assert node.engine_settings["max_num_seqs"] == 64
    assert node.engine_settings["dtype"] == "float32"  # the spec's (tiny-moe's default)
    bf16 = spec.model_copy(update={"model": spec.model.model_copy(update={"dtype": "bfloat16"})})
    node = InferenceNode(NodeKey.generate(), bf16, BOOTSTRAP, tmp_path / "node2", engine="vllm")
    assert node.engine_settings["dtype"] == "bfloat16"  # a checkpoint's default: the node serves what validators judge
