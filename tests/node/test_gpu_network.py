"""`sim --device cuda`'s placement, and benchmarks.gpu_network end to end on the CPU (the same network and
analysis the H200 run uses; the GPU run itself is a benchmark, benchmarks/results/gpu_network-*.json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from node.sim_devices import place

ROOT = Path(__file__).resolve().parents[2]


def test_placement_puts_the_trainer_alone_on_gpu0_and_spreads_inference_over_the_rest():
    two = place("cuda", 3, gpus=2)
    assert two.trainer == "cuda:0" and two.validator == "cuda:1" and two.inference == ("cuda:1",) * 3
    four = place("cuda", 5, gpus=4)
    assert four.inference == ("cuda:1", "cuda:2", "cuda:3", "cuda:1", "cuda:2") and four.validator == "cuda:3"
    one = place("cuda", 2, gpus=1)  # one GPU: every role shares it
    assert (one.trainer, one.validator, one.inference) == ("cuda:0", "cuda:0", ("cuda:0", "cuda:0"))
    assert place("cpu", 2).inference == ("cpu", "cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        place("cuda", 1, gpus=0)
    with pytest.raises(ValueError, match="expected cpu or cuda"):
        place("tpu", 1)


def test_a_role_placed_on_gpu_i_sees_only_that_gpu_as_cuda0(tmp_path):
    # Triton kernels and CUDA graphs launch on the thread's current device (cuda:0 in a new thread): a role
    # on cuda:1 that saw both GPUs crashed on the H200 pair; it now sees only its own
    from node.sim_procs import Proc

    p = Proc("inference-0", ["join", "--role", "inference", "--device", "cuda:1", "--engine", "builtin-cuda"],
             tmp_path / "log.txt")
    assert p.env == {"CUDA_VISIBLE_DEVICES": "1"} and p.argv[p.argv.index("--device") + 1] == "cuda:0"
    cpu = Proc("trainer", ["join", "--role", "trainer", "--device", "cpu"], tmp_path / "log.txt")
    assert cpu.env == {} and "cpu" in cpu.argv


@pytest.mark.slow(seconds=60)
@pytest.mark.timeout(1500)  # two sims, each under its own hang guard (--timeout)
def test_gpu_network_benchmark_runs_the_network_at_two_ks_and_accounts_every_stage(tmp_path):
    # the limits only catch a hang: a run takes ~40 s alone and several times that on a loaded machine
    cmd = [sys.executable, "-m", "benchmarks.gpu_network", "--device", "cpu", "--model", "tiny-moe", "--ks", "0,1",
           "--steps", "3", "--warmup", "1", "--batch-groups", "4", "--group-size", "2", "--timeout", "600",
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1400,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["k"] for r in result["runs"]] == [0, 1] and all(r["status"] == "done" for r in result["runs"])
    assert result["lr"] == 3e-5  # a model that learns trains at the pretrained rate; a random: one at an LLM RL step's
    assert result["rollouts_lost"] == 0 and result["rollouts_duplicated"] == 0 and result["off_policy_violations"] == 0
    for run in result["runs"]:
        assert run["steps"] == 3 and run["steady_steps"] == 2
        assert run["step_s"] > 0 and run["train_s"] > 0 and run["publish_s"] > 0 and run["wait_s"] >= 0
        assert run["wire_s"] is not None and run["wire_s"] >= 0  # the wire shards after the announcement
        # the steady versions are deltas (a keyframe every 8): smaller on the wire than the version itself
        assert run["wire_mib_per_delta"] > 0 and run["raw_over_wire_delta"] > 1
        assert run["weight_latency_s"] is not None and run["weight_latency_s"] > 0
        assert run["gen_tok_s_busy"] > 0 and run["verify_tok_s_busy"] > 0 and run["verify_over_generate"] > 0
        assert run["node_seqs_in_flight"]["max"] >= run["node_seqs_in_flight"]["p50"] > 0
        # the engine's steps: sequences advanced per step (at most its leased groups' members) and a step's time
        assert 0 < run["engine_seqs_decoding_mean"] <= run["node_seqs_in_flight"]["max"]
        assert run["engine_step_ms"] > 0 and 0 < run["engine_step_cpu_ms"] <= run["engine_step_ms"] * 1.05
        # the inference process's threads beside the engine's: the engine's own thread among them, on a core
        assert run["inference_threads"]["engine"]["cpu"] > 0 and "MainThread" in run["inference_threads"]
        # the engine's step by phase: decoding every step, each phase's CPU within its wall time
        phases = run["engine_phases_ms"]
        assert phases["decode"]["wall"] > 0 and phases["prefill"]["wall"] > 0 and "finish" in phases
        assert all(0 <= p["cpu"] <= p["wall"] * 1.05 + 0.01 for p in phases.values())
        assert run["stalls"]["validator_turn_wait_max_s"] >= 0
        assert run["max_off_policy_seen"] <= run["k"]
        # the weight path's stages as the roles recorded them, and one store for the host (sim shares it)
        stages = run["weight_latency_stages_s"]
        assert {"announce_s", "fetch_verify_s", "swap_wait_s", "swap_s"} <= set(stages)
        if "lease_wait_s" in stages:  # the swap's wait split: the leases' round trip, then the admission (session 32)
            assert stages["admit_s"] >= 0 and stages["lease_wait_s"] <= stages["swap_wait_s"] + 1e-3
        assert run["store_disk"]["stores"] == 1 and run["store_disk"]["versions"] >= 1
        assert run["store_disk"]["bytes"] >= run["store_disk"]["bytes_per_version_max"] > 0
        # where it stood still: the node's slowest lease call is in its log, its idle seconds in its rounds
        assert run["stalls"]["lease_call_max_s"] is not None and run["stalls"]["node_idle_s"] >= 0
        assert run["stalls"]["coordinator_slow_commits"] >= 0
        holds = run["stalls"]["validator_holds"]  # the versions the validator held inside the window, if any
        assert holds == 0 or (run["stalls"]["validator_hold_s"] > 0 and 0 <= run["stalls"]["validator_holds_from_changes"] <= holds)
    assert result["async_speedup"] == round(result["runs"][0]["step_s"] / result["runs"][1]["step_s"], 2)
    # the role's engine alone on the same workload, the bound the network's generation is held against
    assert result["engine_alone_tok_s"] > 0 and result["engine_alone_rollouts"] == 2 * 4 * 2
    assert 0 < result["engine_alone_seqs_decoding_mean"] <= result["engine_alone_slots"]
    assert result["engine_alone_step_ms"] > 0 and 0 < result["engine_alone_step_cpu_ms"] <= result["engine_alone_step_ms"] * 1.05
    assert 0 < result["engine_alone_phases_ms"]["decode"]["wall"] <= result["engine_alone_step_ms"] * 1.05
    assert result["trained_over_engine_alone"] > 0 and result["gpu_busy_share"] is None  # no nvidia-smi here
    # each role's rate per trained token while it worked, and what they allow back to back
    last = result["runs"][-1]
    assert last["verify_completion_tok_s_busy"] > 0 and last["train_tok_s_busy"] > 0
    assert 0 < result["back_to_back_over_engine_alone"] < 1 and result["trained_over_back_to_back"] > 0
    assert (tmp_path / "report.png").stat().st_size > 10_000 and (tmp_path / "k0.json").exists()
    # the benchmark's trainer writes no checkpoint (`--checkpoint-every 0`): the steady state is its measure
    assert "checkpoint written" not in (tmp_path / "k0" / "trainer" / "log.txt").read_text()
    # each swap says when the node first asked for, and first got, leases holding that version (None: not yet)
    swaps = [json.loads(x) for x in (tmp_path / "k0" / "inference-0" / "swaps.jsonl").read_text().splitlines()]
    assert swaps and all({"t_lease_asked", "t_granted"} <= set(row) for row in swaps)
    assert any(row["t_granted"] is not None and row["t_lease_asked"] <= row["t_granted"] <= row["t_applied"]
               for row in swaps)
    # the figures again from the records alone (as a device call brings a run back): the same, said to be reread
    again = subprocess.run([sys.executable, "-m", "benchmarks.gpu_network", "--reread", str(tmp_path)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    reread = json.loads(again.stdout.strip().splitlines()[-1])
    assert reread["reread"] and reread["engine_alone_tok_s"] == result["engine_alone_tok_s"]
    for key in ("step_s", "gen_tok_s", "trained_tok_s", "verify_over_generate", "weight_latency_s", "async_speedup",
                "rollouts_lost", "store_disk"):
        assert reread[key] == result[key], key
    assert [r["k"] for r in reread["runs"]] == [0, 1] and reread["runs"][1]["stalls"] == result["runs"][1]["stalls"]


@pytest.mark.slow  # a whole network of processes: runs after the fast tests
def test_a_role_that_cannot_start_ends_the_sim_at_once_instead_of_at_its_timeout(tmp_path):
    import time

    import torch

    from node.sim import run_sim
    from node.sim_devices import Placement

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA (the node asks for a GPU that is not there)")
    t0 = time.time()
    s = run_sim(tmp_path, inference_nodes=1, steps=3, batch_groups=2, group_size=2, timeout_s=300,
                placement=Placement("cpu", "cpu", ("cuda:0",)))
    assert s["status"] == "inference-0 exited with code 1" and s["steps"] == 0
    assert time.time() - t0 < 120  # not the 300 s timeout
    assert "no CUDA device" in (tmp_path / "inference-0" / "log.txt").read_text()


def test_stalls_are_read_from_the_coordinators_slow_commits_the_nodes_lease_calls_and_its_idle_gaps(tmp_path):
    """`benchmarks.gpu_network.stalls` over a run directory as the roles write it (the log lines' own formats)."""
    from benchmarks.gpu_network import stalls

    (tmp_path / "coordinator").mkdir()
    (tmp_path / "coordinator" / "log.txt").write_text(
        "10:01:40 WARNING protocol.store: coordinator store: 1 commits over 0.2 s in the last 40 s (slowest 0.49 s): x\n"
        "10:02:01 WARNING protocol.store: coordinator store: 3 commits over 0.2 s in the last 12 s (slowest 4.37 s): x\n")
    node = tmp_path / "inference-0"
    node.mkdir()
    (node / "log.txt").write_text("10:04:12 INFO node.roles.inference: inference x stopped: 304 groups submitted, 0 "
                                  "refused; 98 granting lease calls, median 0.056 s, max 8.869 s\n")
    rounds = [{"t0": 0.0, "t1": 1.0}, {"t0": 1.0, "t1": 2.0}, {"t0": 5.0, "t1": 6.0}, {"t0": 6.5, "t1": 7.0}]
    (node / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    got = stalls(tmp_path, 1, (0.0, 10.0))
    assert got == {"coordinator_slow_commits": 4, "coordinator_commit_max_s": 4.37, "lease_call_max_s": 8.869,
                   "node_idle_s": 3.5, "validator_turn_wait_s": None, "validator_turn_wait_max_s": None,
                   "validator_verify_s": 0.0, "validator_slowest_round": None, "validator_gc_s": None,
                   "validator_hold_s": None, "validator_hold_max_s": None, "validator_holds_from_changes": None,
                   "validator_holds": 0}
    (tmp_path / "validator").mkdir()
    (tmp_path / "validator" / "rounds.jsonl").write_text("".join(
        json.dumps({"t0": t, "t1": t + 1, "turn_wait_s": w, "verify_s": v, "units": u, "mixed": m, "gc_s": g}) + "\n"
        for t, w, v, u, m, g in ((0.0, 2.0, 9.0, 64, 0, 0.0), (3.0, 0.25, 4.0, 60, 12, 0.5), (6.0, 0.5, 0.1, 64, 0, 0.25))))
    got = stalls(tmp_path, 1, (2.0, 10.0))  # the rounds inside the window
    assert (got["validator_turn_wait_s"], got["validator_turn_wait_max_s"]) == (0.75, 0.5)
    assert got["validator_slowest_round"] == {"turn_wait_s": 0.25, "verify_s": 4.0, "units": 60, "mixed": 12, "gc_s": 0.5}
    assert got["validator_gc_s"] == 0.75 and got["validator_verify_s"] == 4.1
    assert stalls(tmp_path, 1, (5.5, 10.0))["node_idle_s"] == 0.5  # only gaps after the steady state began
    assert stalls(tmp_path, 1, (0.0, 5.5))["node_idle_s"] == 3.0  # and before it ended
    assert stalls(tmp_path, 1, (0.0, 5.5))["validator_verify_s"] == 13.0
    # the versions it held (node/version_trace.py's rows of `on_held`): inside the window, read whole or not
    (tmp_path / "validator" / "versions.jsonl").write_text("".join(
        json.dumps({"version": v, "t_held": t, "hold_s": h, "changed_bytes": c}) + "\n"
        for v, t, h, c in ((1, 1.0, 7.0, None), (2, 3.0, 2.0, None), (3, 4.0, 0.5, 9000), (4, 6.0, 0.25, 4000))))
    got = stalls(tmp_path, 1, (2.0, 10.0))
    assert (got["validator_holds"], got["validator_holds_from_changes"]) == (3, 2)
    assert (got["validator_hold_s"], got["validator_hold_max_s"]) == (0.5, 2.0)


def test_steady_figures_count_only_what_happened_inside_the_steady_window(tmp_path):
    """Generation, verification and the GPU's busy share are steady-state figures: the rounds and GPU samples after
    the last steady step (the last checkpoint, the processes stopping: a minute at 5.2B) count for nothing, and a
    round that straddles an end counts for the share of it inside. (Until session 39 everything after the window's
    start counted, which halved the 5.2B run's busy share and doubled the 0.52B run's generation rate.)"""
    from benchmarks.gpu_network import gpu_busy, memory_by_role, throughput

    rounds = [{"t0": 9.0, "t1": 10.0, "tokens": 100, "busy_s": 1.0},   # before: nothing
              {"t0": 10.5, "t1": 11.5, "tokens": 400, "busy_s": 0.5},  # half inside
              {"t0": 12.0, "t1": 13.0, "tokens": 300, "busy_s": 1.0},  # inside
              {"t0": 21.0, "t1": 22.0, "tokens": 9000, "busy_s": 1.0}]  # after: nothing
    rate, busy, tokens = throughput(rounds, (11.0, 20.0))
    assert (busy, tokens) == (1.25, 500.0) and rate == 400.0
    assert throughput(rounds, (0.0, 100.0))[2] == 9800  # the whole run
    csv = tmp_path / "k1.gpu.csv"
    csv.write_text("".join(f"{t:.2f}, 0, {u}, {m}\n" for t, u, m in
                           ((10.0, 0, 1000), (11.0, 80, 2048), (15.0, 60, 4096), (20.0, 100, 2048), (30.0, 0, 9216))))
    assert gpu_busy(csv, (11.0, 20.0)) == {"cuda:0": {"busy_share": 0.8, "samples": 3, "memory_gib_max": 4.0}}
    assert gpu_busy(csv)["cuda:0"]["samples"] == 5 and gpu_busy(tmp_path / "none.csv") == {}
    apps = tmp_path / "k1.gpu.apps.csv"
    apps.write_text("1.00, trainer, 2048\n2.00, pid 7 (python3), 512\n3.00, trainer, 4096\nbroken line\n")
    assert memory_by_role(apps) == {"pid 7 (python3)": 0.5, "trainer": 4.0}


def test_the_coordinators_state_and_the_store_can_live_elsewhere_behind_the_same_paths(tmp_path):
    """`sim --coordinator-state DIR` / `--store-dir DIR`: OUT/coordinator or OUT/shardcast links to DIR (every path the
    sim and the audit read stays the same); asked again it is kept, and one that is something else is refused, not
    replaced; `drop_stores` empties a linked store where it lies."""
    from benchmarks.gpu_network import drop_stores
    from node.sim_network import link_elsewhere

    out, state, store = tmp_path / "run", tmp_path / "elsewhere" / "coord", tmp_path / "shm" / "store"
    out.mkdir()
    link_elsewhere(out, "coordinator", state)
    (out / "coordinator" / "log.txt").write_text("x")
    assert (state / "log.txt").read_text() == "x" and (out / "coordinator").is_symlink()
    link_elsewhere(out, "coordinator", state)  # the same link: kept
    other = tmp_path / "other"
    (other / "coordinator").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="cannot also be"):
        link_elsewhere(other, "coordinator", state)
    link_elsewhere(out, "shardcast", store)
    (out / "shardcast" / "r").mkdir()
    (out / "shardcast" / "r" / "payload").write_bytes(b"\0" * 1000)
    drop_stores(out)
    assert not (store / "r").exists() and (state / "log.txt").exists()


def test_async_speedup_is_told_for_every_k_against_the_synchronous_run():
    """`async_speedup` is the largest k's (k = 0's step over its own); `async_speedup_by_k` each k's, so a run of
    k = 2, 1 and 0 also gives the issue's k = 1 figure; no k = 0 run (or no step): none."""
    from benchmarks.gpu_network import speedups

    runs = [{"k": 2, "step_s": 2.419}, {"k": 1, "step_s": 3.53}, {"k": 0, "step_s": 4.912}]
    assert speedups(runs) == {1: 1.39, 2: 2.03}  # session 36's H100 runs
    assert speedups(runs[:2]) == {} and speedups([{"k": 1, "step_s": None}, {"k": 0, "step_s": 4.0}]) == {}


def test_back_to_back_adds_each_roles_seconds_per_trained_token():
    """One GPU that generates at the engine alone's 30k tok/s, judges completions at 30k and trains at 15k spends
    1/30k + 1/30k + 1/15k s on a trained token: 7,500 tok/s back to back, 0.25 of the engine alone; a network that
    trained 3,000 tok/s reached 0.4 of it (idle between), one that trained 9,000, 1.2 (the roles overlapped). Without
    a rate there is no figure."""
    from benchmarks.gpu_network import back_to_back

    run = {"verify_completion_tok_s_busy": 30_000.0, "train_tok_s_busy": 15_000.0, "trained_tok_s": 3_000.0}
    assert back_to_back(run, 30_000.0) == {"back_to_back_tok_s": 7500.0, "back_to_back_over_engine_alone": 0.25,
                                           "trained_over_back_to_back": 0.4}
    assert back_to_back({**run, "trained_tok_s": 9_000.0}, 30_000.0)["trained_over_back_to_back"] == 1.2
    assert back_to_back({**run, "verify_completion_tok_s_busy": None}, 30_000.0) == {"back_to_back_tok_s": None}
    assert back_to_back(run, None) == {"back_to_back_tok_s": None}


def test_a_random_model_trains_at_an_llm_rl_rate_unless_told_otherwise():
    from argparse import Namespace

    from benchmarks.gpu_network import PRETRAINED_LR, RANDOM_MODEL_LR, workload_defaults

    def filled(**given):
        args = Namespace(**{**dict(device="cuda", model=None, dtype=None, lr=None, batch_groups=None, task=None), **given})
        workload_defaults(args)
        return args

    gpu = filled()
    assert (gpu.model, gpu.dtype, gpu.lr, gpu.batch_groups, gpu.task) == ("random:qwen3-30b-a3b-8l", "bfloat16", 1e-5, 32,
                                                                           "reverse-text-long")
    # a bf16 master's step at 1e-5 changes about what an fp32 master's at an LLM RL rate (1e-6) does
    assert RANDOM_MODEL_LR == {"float32": 1e-6, "bfloat16": 1e-5}
    assert filled(model="random:qwen3-moe-small", dtype="float32").lr == 1e-6
    assert filled(master_float32=True).lr == 1e-6  # a bf16 run whose trainer keeps a float32 master
    assert filled(device="cpu").lr == PRETRAINED_LR and filled(model="tiny-moe").lr == PRETRAINED_LR
    assert filled(lr=3e-5).lr == 3e-5  # the operator's word wins
