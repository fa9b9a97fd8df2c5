"""Every role's memory plan, made from the model's config before anything is allocated
(node/engine/memory_plan.py, node/roles/memory.py): printed when it fits, one line and exit 2 when not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from benchmarks.random_checkpoint import QWEN3_30B_A3B
from node.engine.memory_plan import GIB, MemoryPlanDoesNotFit, plan_trainer, weight_bytes
from node.model.config import ModelConfig
from node.roles.memory import role_plan, shared_device_plans
from node.run_config import RunConfig, to_toml
from node.sim_procs import free_port
from protocol.identity import NodeKey

QWEN3_30B = ModelConfig(**{**QWEN3_30B_A3B, "num_hidden_layers": 48}, vocab_size=151_936,
                        max_position_embeddings=4096)
COORDINATOR = NodeKey.from_seed(b"c" * 32).peer_id
BOOTSTRAP = f"/ip4/127.0.0.1/tcp/1/p2p/{COORDINATOR}"  # never dialled: the plan refuses first


def write_spec(tmp: Path, model: dict | None = None) -> Path:
    values = {"run_id": "plan", "task": "reverse", "batch_groups": 4, "group_size": 2,
              "trainer": NodeKey.from_seed(b"t" * 32).peer_id, "validators": [NodeKey.from_seed(b"v" * 32).peer_id],
              "listen": f"/ip4/127.0.0.1/tcp/{free_port()}", "status_port": 0}
    if model is not None:
        values["model"] = model
    (tmp / "run.toml").write_text(to_toml(values))
    spec = RunConfig.load(tmp / "run.toml").run_spec(COORDINATOR)
    (tmp / "spec.json").write_text(spec.model_dump_json())
    return tmp / "spec.json"


def qwen3_30b_dir(tmp: Path) -> Path:
    """The 48-layer Qwen3-30B-A3B shape's config.json alone: no weights (the plan needs none)."""
    d = tmp / "qwen3-30b-a3b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN3_30B.to_hf_dict("bfloat16")))
    return d


def run_cli(*argv: str) -> tuple[int, str, str, int]:
    """(exit code, stdout, stderr, peak RSS in MiB) of `python -m node.cli ARGV`."""
    p = subprocess.Popen([sys.executable, "-m", "node.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    killer = threading.Timer(300, p.kill)  # every wait has a limit
    killer.start()
    try:
        out, err = p.stdout.read(), p.stderr.read()  # a few lines: no pipe fills while the other is read
        _, status, usage = os.wait4(p.pid, 0)  # reaped here, with its resource usage
    finally:
        killer.cancel()
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, out, err, usage.ru_maxrss // 1024


def test_a_trainer_rank_holds_weights_gradients_and_two_adamw_states_divided_by_its_fsdp_world():
    one = plan_trainer(QWEN3_30B, torch.bfloat16, "cuda:0", 140 * GIB, 16_384, 1 << 30)
    eight = plan_trainer(QWEN3_30B, torch.bfloat16, "cuda:0", 140 * GIB, 16_384, 1 << 30, world=8)
    parts, parts8 = dict(one.parts), dict(eight.parts)
    assert parts["weights"] == QWEN3_30B.num_parameters() * 2  # bfloat16
    assert parts["gradients"] == parts["weights"] and parts["AdamW states"] == 2 * parts["weights"]
    assert parts8["weights"] == parts["weights"] // 8 and parts8["AdamW states"] == parts["AdamW states"] // 8
    assert "AdamW 2 states in bfloat16" in one.describe() and "FSDP world 8" in eight.describe()
    with pytest.raises(MemoryPlanDoesNotFit):
        one.check()  # 30.5B parameters x 8 bytes of state: no single H200
    eight.check()
    # FP8 experts: one byte each plus their block scales
    assert weight_bytes(QWEN3_30B, torch.bfloat16, "experts") < 0.6 * weight_bytes(QWEN3_30B, torch.bfloat16)


def test_the_tiny_model_fits_every_role_on_this_machine_and_roles_on_one_device_are_summed(tmp_path):
    spec = RunConfig.load(Path(write_spec(tmp_path)).with_name("run.toml")).run_spec(COORDINATOR)
    plans = [role_plan(spec, r, "cpu") for r in ("trainer", "validator", "inference")]
    for p in plans:
        assert p.check() is p and "GiB free" in p.describe()
    (shared,) = shared_device_plans(plans)
    assert shared.total == sum(p.total for p in plans) and "trainer weights" in shared.describe()
    assert role_plan(spec, "relay", "cpu") is None


@pytest.mark.parametrize("role", ["trainer", "validator", "inference"])
def test_the_30b_shape_is_refused_by_the_plan_in_one_line_with_exit_2_before_anything_is_allocated(tmp_path, role):
    spec = write_spec(tmp_path, {"source": str(qwen3_30b_dir(tmp_path)), "dtype": "bfloat16"})
    code, out, err, rss_mib = run_cli("join", "--role", role, "--bootstrap", BOOTSTRAP, "--spec", str(spec),
                                      "--workdir", str(tmp_path / "w"), "--memory-limit-gib", "40")
    assert code == 2, (out, err)
    assert out.startswith("memory plan: ") and "GiB free" in out
    line = err.strip()
    assert "\n" not in line and "needs" in line and "is free" in line and "Traceback" not in err
    # a 57 GiB model never built: the process held what python and torch take to start (about 0.5 GiB
    # here, 1.3 GiB with the CUDA libraries of a GPU machine)
    assert 0 < rss_mib < 4096, rss_mib


def test_a_plan_that_fits_is_printed_and_the_memory_limit_knob_refuses_one_that_does_not(tmp_path):
    code, out, err, _ = run_cli("train-local", "--out", str(tmp_path / "tl"), "--steps", "1", "--prompts", "2",
                                "--samples", "2", "--warmup-target", "0", "--threads", "1")
    assert code == 0, err
    assert out.startswith("memory plan: trainer + inference node on cpu") and "AdamW 2 states in float32" in out
    code, out, err, _ = run_cli("train-local", "--out", str(tmp_path / "tl2"), "--memory-limit-gib", "0.001")
    assert code == 2 and "needs" in err and "1.0 MiB is free" in err and not (tmp_path / "tl2" / "metrics.jsonl").exists()
    spec = write_spec(tmp_path)
    code, out, err, _ = run_cli("join", "--role", "validator", "--bootstrap", BOOTSTRAP, "--spec", str(spec),
                                "--workdir", str(tmp_path / "v"), "--memory-limit-gib", "0.001")
    assert code == 2 and out.startswith("memory plan: validator on cpu: resident model") and "the validator needs" in err


def test_sim_plans_every_role_on_its_device_before_any_process_starts(tmp_path):
    from node.sim_config import SimConfig
    from node.sim_devices import place
    from node.sim_network import plan_network_memory

    spec = write_spec(tmp_path, {"source": str(qwen3_30b_dir(tmp_path)), "dtype": "bfloat16"})
    cfg = SimConfig(inference_nodes=2)
    with pytest.raises(MemoryPlanDoesNotFit, match="trainer \\+ validator \\+ inference node \\+ inference node"):
        plan_network_memory(spec.with_name("run.toml"), COORDINATOR, cfg, place("cpu", 2))
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    plan_network_memory(write_spec(tiny).with_name("run.toml"), COORDINATOR, cfg, place("cpu", 2))


def test_a_gpu_validators_logits_are_capped_at_a_token_count_not_a_quarter_of_the_gpu():
    from node.replay import CPU_LOGITS_BYTES, GPU_PREFILL_TOKENS, logits_budget_of, prefill_batch_tokens

    free = 137 << 30  # an H200 before the roles sharing it load
    budget = logits_budget_of("cuda", free, 151_936)
    assert budget == 12 * 151_936 * GPU_PREFILL_TOKENS < free // 4  # 14.9 GB, not 34 GiB
    assert prefill_batch_tokens(budget, 151_936, on_device=True) == GPU_PREFILL_TOKENS
    assert logits_budget_of("cuda", 4 << 30, 151_936) == 1 << 30  # a small GPU: its share still rules
    assert logits_budget_of("cuda", free, 88) == CPU_LOGITS_BYTES  # a tiny vocabulary keeps the floor
    assert logits_budget_of("cpu", free, 151_936) == CPU_LOGITS_BYTES


def test_a_gpu_validator_plans_activations_for_the_tokens_one_forward_takes(monkeypatch):
    """Packed on a GPU in bf16 (`node.replay.packing`), one forward takes a whole group of claims (logits budget / 4
    bytes a vocabulary row: 3x the padded batch at Qwen3's vocabulary); padded (float32, or PRIMERL_JUDGE_PACKED=0)
    the padded batch; the CPU always pads."""
    import torch

    from node.replay import forward_tokens, logits_budget_of, prefill_batch_tokens

    budget = logits_budget_of("cuda", 137 << 30, 151_936)
    padded = prefill_batch_tokens(budget, 151_936, on_device=True)
    cuda = torch.device("cuda")
    assert forward_tokens(budget, 151_936, cuda, torch.bfloat16) == budget // (4 * 151_936) == 3 * padded
    assert forward_tokens(budget, 151_936, cuda, torch.float32) == padded
    assert forward_tokens(budget, 151_936, torch.device("cpu"), torch.bfloat16) == prefill_batch_tokens(
        budget, 151_936, on_device=False)
    monkeypatch.setenv("PRIMERL_JUDGE_PACKED", "0")
    assert forward_tokens(budget, 151_936, cuda, torch.bfloat16) == padded


def test_the_trainers_plan_matches_what_the_5b_trainer_held_on_an_h200():
    """Session 15's measurement (`python -m benchmarks.trainer_profile`, one H200): the 5.2B qwen3-30b-a3b-8l
    trainer in bf16 with 16,384-token micro-batches peaked at 73.0 GiB allocated; the per-tensor count
    alone planned 60.4 GiB (`TRAIN_ACTIVATION_SCALE` closes the gap)."""
    from benchmarks.random_checkpoint import SHAPES
    from node.model.config import ModelConfig

    cfg = ModelConfig(**SHAPES["qwen3-30b-a3b-8l"], vocab_size=49152, max_position_embeddings=1536)
    plan = plan_trainer(cfg, torch.bfloat16, "cuda:0", 136 * GIB, 16_384, 1 << 30, longest_row=1536)
    assert plan.micro_batch_tokens == 16_384
    assert abs(plan.total / GIB - 73.0) < 0.02 * 73.0, plan.describe()


def test_model_plan_tells_a_joiner_what_each_role_would_hold_on_a_device_that_is_not_here(tmp_path):
    # an H200's worth, asked on this CPU machine: a 30B node fits on one, its trainer does not, 8 ranks do
    spec = write_spec(tmp_path, {"source": str(qwen3_30b_dir(tmp_path)), "fp8": "all"})
    code, out, err, _ = run_cli("model", "plan", "--spec", str(spec), "--device", "cuda", "--free-gib", "139")
    lines = out.splitlines()
    assert [line.split(":")[1].strip().split(" on ")[0] for line in lines] == ["inference node", "validator", "trainer"]
    assert all("139.00 GiB free" in line for line in lines), out
    assert code == 2 and "the trainer needs" in err and "inference" not in err and len(err.strip().splitlines()) == 1, err
    code, out, err, _ = run_cli("model", "plan", "--spec", str(spec), "--free-gib", "139", "--role", "trainer", "--dp", "8")
    assert code == 0 and "FSDP world 8" in out, err
    code, out, err, _ = run_cli("model", "plan", "--spec", str(spec), "--device", "cpu", "--free-gib", "20",
                                "--role", "inference")
    assert code == 2 and "the inference node needs" in err, err
    (tmp_path / "junk.json").write_text("{not a spec")
    code, _, err, _ = run_cli("model", "plan", "--spec", str(tmp_path / "junk.json"), "--free-gib", "139")
    assert code == 2 and err.startswith("primerl-node model: error: --spec") and "Traceback" not in err, err
