"""The commands a person types: publish a safetensors checkpoint, list it, fetch it back."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from protocol.identity import NodeKey

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "node.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_publish_ls_fetch_from_the_command_line(tmp_path, sc):
    key = NodeKey.generate()
    key.save(tmp_path / "trainer.key")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    state = sc.make_state(3)
    save_file(state, str(ckpt / "model.safetensors"))
    pub = _cli("shardcast", "publish", "--store", str(tmp_path / "origin"), "--key", str(tmp_path / "trainer.key"),
               "--run", "r1", "--version", "0", "--weights", str(ckpt), "--shard-mib", "1")
    assert pub.returncode == 0, pub.stderr
    info = json.loads(pub.stdout.strip().splitlines()[-1])
    assert info["encoding"] == "full" and info["publisher"] == key.peer_id and info["wire_bytes"] < info["raw_bytes"]
    ls = _cli("shardcast", "ls", "--store", str(tmp_path / "origin"))
    assert "r1\tv0\tfull" in ls.stdout and "complete" in ls.stdout

    server = subprocess.Popen([sys.executable, "-m", "node.cli", "shardcast", "serve", "--store", str(tmp_path / "origin"), "--port", "0"],
                              cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().split()[-1]  # type: ignore[union-attr]
        out = tmp_path / "fetched.safetensors"
        got = _cli("shardcast", "fetch", "--store", str(tmp_path / "me"), "--source", url, "--run", "r1",
                   "--trust", key.peer_id, "--out", str(out), "--no-progress")
        assert got.returncode == 0, got.stderr
        sc.assert_same(dict(sorted(load_file(str(out)).items())), dict(sorted(state.items())))
        refused = _cli("shardcast", "fetch", "--store", str(tmp_path / "other"), "--source", url, "--run", "r1",
                       "--trust", NodeKey.generate().peer_id, "--no-progress")
        assert refused.returncode == 1 and "UnknownPublisher" in refused.stderr
    finally:
        server.kill()
        server.wait(10)
