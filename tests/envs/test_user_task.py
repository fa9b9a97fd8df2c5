"""User tasks (issue 17, item 8): `--task module:attr` names a native Environment from the user's
module in every role (they all load the spec's environment through `get_env`); the signed spec pins
the module's source hash, and a node whose module differs refuses to run."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
from cli_runs import cli, run_at_once

from node.envs import Environment, get_env
from node.envs.user import TaskMismatch, task_identity
from node.run_config import RunConfig, to_toml
from protocol.identity import NodeKey

SOURCE = textwrap.dedent('''
    from node.envs.base import Environment, Task

    class Echo(Environment):
        name = "echo"
        max_new_tokens = 8

        def sample_task(self, seed):
            return Task(f"echo-{seed}", f"{seed % 10}=", str(seed % 10))

        def reward(self, task, transcript):
            return float(transcript.strip().startswith(task.answer))
''')


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_tasks", None)
    yield tmp_path / "my_tasks.py"
    sys.modules.pop("my_tasks", None)


def test_a_native_environment_from_a_user_module_loads_and_grades(user_module):
    env = get_env("my_tasks:Echo")
    assert isinstance(env, Environment)
    task = env.sample_task(13)
    assert env.reward(task, "3") == 1.0 and env.reward(task, "4") == 0.0


def test_the_spec_pins_the_source_and_a_node_with_other_code_refuses(user_module, tmp_path):
    (tmp_path / "run.toml").write_text(to_toml({"run_id": "u", "task": "my_tasks:Echo", "verification_rate": 0.0,
                                                 "trainer": NodeKey.generate().peer_id}))
    spec = RunConfig.load(tmp_path / "run.toml").run_spec(NodeKey.generate().peer_id)
    assert spec.environment.startswith("my_tasks:Echo@") and len(spec.environment.split("@")[1]) == 16
    assert isinstance(get_env(spec.environment), Environment)  # what every role does with the spec
    user_module.write_text(SOURCE.replace("startswith(task.answer)", "endswith(task.answer)"))  # another version
    sys.modules.pop("my_tasks", None)
    importlib.invalidate_caches()
    with pytest.raises(TaskMismatch, match="pins"):
        get_env(spec.environment)
    assert task_identity("my_tasks:Echo") != spec.environment
    with pytest.raises(TaskMismatch):
        get_env("my_tasks:Nope")


@pytest.mark.slow
def test_train_local_runs_a_user_task_from_the_command_line(user_module, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "node.cli", "train-local", "--task", "my_tasks:Echo", "--steps", "1",
                          "--prompts", "2", "--samples", "2", "--warmup-target", "0", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_role_with_another_version_or_without_the_module_says_so_in_one_line_and_exits_2(user_module, tmp_path):
    # the walk-through: both ended in a TaskMismatch traceback (exit 1)
    from node.sim_procs import free_port

    spec = RunConfig.model_validate({"run_id": "u", "task": "my_tasks:Echo", "verification_rate": 0.0,
                                     "trainer": NodeKey.generate().peer_id}).run_spec(NodeKey.generate().peer_id)
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    other = tmp_path / "other"
    other.mkdir()
    (other / "my_tasks.py").write_text(SOURCE.replace("startswith(task.answer)", "endswith(task.answer)"))
    bootstrap = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{spec.coordinator}"  # never reached: refused before
    (tmp_path / "run.toml").write_text(to_toml({"run_id": "u", "task": "my_tasks:Echo", "verification_rate": 0.0,
                                                 "trainer": NodeKey.generate().peer_id, "status_port": 0,
                                                 "listen": f"/ip4/127.0.0.1/tcp/{free_port()}"}))
    joins = ((other, "the run pins"), (tmp_path / "empty", "put the directory holding the module on PYTHONPATH"))
    *joined, launched = run_at_once(
        [cli("join", "--role", "inference", "--bootstrap", bootstrap, "--spec", str(tmp_path / "spec.json"),
             "--workdir", str(tmp_path / f"inf-{i}"),
             env={"PYTHONPATH": os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")])})
         for i, (path, _) in enumerate(joins)]
        # the coordinator cannot import my_tasks either
        + [cli("coordinator", "launch", "--config", str(tmp_path / "run.toml"), "--state", str(tmp_path / "state"))])
    for (_, says), out in zip(joins, joined):
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    out = launched
    assert out.returncode == 2 and "PYTHONPATH" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_the_task_file_in_docs_node_md_loads_and_grades(tmp_path, monkeypatch):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "node.md").read_text()
    source = text.split("```python\n# my_module.py", 1)[1].split("```", 1)[0]
    (tmp_path / "my_module.py").write_text("# my_module.py" + source)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_module", None)
    try:
        spec_task = task_identity("my_module:MyEnv")
        env = get_env(spec_task)
        task = env.sample_task(7)
        assert env.reward(task, task.answer) == 1.0 and env.reward(task, "") == 0.0
        from node.model.tokenizer import CharTokenizer
        tok = CharTokenizer()
        assert tok.decode(tok.encode(task.prompt)) == task.prompt  # the tiny model can read it
    finally:
        sys.modules.pop("my_module", None)
