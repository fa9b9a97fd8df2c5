"""`join --role inference --engine vllm` refuses to start, with one line saying why, when the run
does not accept vLLM rollouts or there is no usable vLLM interpreter; it never reaches the network.
Needs no vLLM (a valid interpreter is exercised by test_vllm_sim.py)."""

from __future__ import annotations

import sys

import pytest

from node.cli import main
from protocol.messages import RunSpec

BOOTSTRAP = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def _join(tmp_path, engines, capfd) -> tuple[int, str]:
    spec = tmp_path / "spec.json"
    spec.write_text(RunSpec(run_id="r", coordinator="c", environment="reverse", engines=engines).model_dump_json())
    rc = main(["join", "--role", "inference", "--engine", "vllm", "--spec", str(spec), "--bootstrap", BOOTSTRAP,
               "--workdir", str(tmp_path / "node")])
    return rc, capfd.readouterr().err


def test_a_run_that_does_not_accept_vllm_is_refused_at_start(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("PRIMERL_VLLM_PYTHON", sys.executable)
    rc, err = _join(tmp_path, ("builtin",), capfd)
    assert rc == 2 and "does not accept vLLM rollouts" in err


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
