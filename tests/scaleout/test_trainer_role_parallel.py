"""The trainer role under torchrun (`join --role trainer --dp 2 --ep 2`, gloo on CPU) trains a run
through every other role, and what it publishes is the one-process trainer's step; its checkpoint
is a `Trainer` checkpoint that resumes (in another layout too) to the one-process next step.

Run by torchrun, this file is also the world the checkpoint test drives (see `world_main`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import time
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.parallel_parity import STEP_TOLERANCE, step_errors
from node.model.checkpoint import load_hf_state_dict, state_dict_to_hf
from node.model.qwen3_moe import CausalLM
from node.roles.common import fresh_model
from node.roles.trainer import TrainerNode
from node.rl.parallel.trainer import minibatch_seed
from node.rl.trainer import Trainer
from node.sim import run_sim
from protocol.identity import NodeKey
from protocol.messages import RunSpec


def one_process_step(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """(published v1, the single-process trainer's weights after step 1 on the same batch from
    the published v0, its metrics)."""
    from sim_reads import published, step_units  # tests/ is on the path under pytest, not where torchrun runs this file

    spec = RunSpec.model_validate_json((out / "coordinator" / "spec.json").read_bytes())
    role = TrainerNode(NodeKey.generate(), spec, "", out / "reference", 0)  # its config and batch building
    model = fresh_model(spec)
    load_hf_state_dict(model, published(out, spec, 0))
    batch, _ = role.train_batch(step_units(out, spec, 1))
    torch.manual_seed(minibatch_seed(int(spec.recipe["seed"]), 0))  # Trainer draws from the global generator
    metrics = Trainer(model, role.cfg).train_step(batch)
    return published(out, spec, 1), state_dict_to_hf(model), metrics


@pytest.mark.slow  # a whole network of processes: runs after the fast tests
def test_dp2_ep2_trainer_trains_a_sim_and_publishes_the_one_process_step(tmp_path):
    s = run_sim(tmp_path, inference_nodes=1, steps=3, batch_groups=8, group_size=4,
                trainer_parallel="dp2-ep2")
    assert s["status"] == "done" and s["steps"] == 3, s
    assert s["rollouts_trained"] == 3 * 8 * 4
    assert s["rollouts_lost"] == 0 and s["rollouts_duplicated"] == 0
    assert all(code == 0 for code in s["exit_codes"].values()), s["exit_codes"]
    log = (tmp_path / "trainer" / "log.txt").read_text()
    assert "rank 0 of 2: leading" in log and "rank 1: stop from rank 0 at step 3" in log

    from sim_reads import published

    v1, reference, metrics = one_process_step(tmp_path)
    v0 = published(tmp_path, RunSpec.model_validate_json((tmp_path / "coordinator" / "spec.json").read_bytes()), 0)
    moved = [n for n in reference if not torch.equal(reference[n], v0[n])]
    assert len(moved) > 0.9 * len(reference), sorted(set(reference) - set(moved))  # the step moved (nearly) every tensor
    errors = step_errors(v1, reference, v0)
    assert max(errors.values()) < STEP_TOLERANCE, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    row = json.loads((tmp_path / "trainer" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["lr"] == pytest.approx(metrics["lr"])
    assert row["mismatch_kl"] == pytest.approx(metrics["mismatch_kl"], rel=1e-4, abs=1e-7)



@pytest.mark.slow(seconds=55)
def test_sigterm_mid_run_stops_every_rank_cleanly(tmp_path):
    """The sim's stop (SIGTERM to every rank while the trainer is mid-run): rank 0 finishes its step,
    sends the stop order, and every rank and torchrun exit 0 within the sim's 20 s grace."""
    # stopped once a step is done (a fixed time may pass before the first step on a loaded machine); small
    # batches (2 groups of 2 rollouts, one per rank): the step in flight at the SIGTERM ends well inside the grace
    s = run_sim(tmp_path, inference_nodes=1, steps=500, batch_groups=2, group_size=2, trainer_parallel="dp2-ep2",
                stop_when=lambda steps: steps >= 1)
    assert s["status"] == "stopped" and 0 < s["steps"] < 500, s
    assert all(code == 0 for code in s["exit_codes"].values()), s["exit_codes"]
    assert s["rollouts_lost"] == 0 and s["rollouts_duplicated"] == 0
    log = (tmp_path / "trainer" / "log.txt").read_text()
    assert "waiting for rank 0's stop order" in log  # rank 1 got the SIGTERM and did not leave on its own
    # the step in flight when the stop came may be trained but not yet logged
    stopped_at = int(re.search(r"rank 1: stop from rank 0 at step (\d+)", log).group(1))
    assert stopped_at in (s["steps"], s["steps"] + 1)

# ---- checkpoint and resume through the world (no network): torchrun runs this file -------------

ROOT = Path(__file__).resolve().parents[2]
SEED = 3


def _check_setup():
    from benchmarks.parallel_parity import check_batch
    from node.model.tiny import TinyMoE
    from node.rl.trainer import TrainerConfig

    cfg = TrainerConfig(lr=1e-3, decay_steps=4)  # the schedule moves between the two steps
    torch.manual_seed(SEED)
    model = CausalLM(TinyMoE(hidden=32, layers=2, experts=4, top_k=2).config(96))  # load-balancing loss on (coef 0.001)
    # 6 rows: minibatches of 3 are padded to 4 rows for dp=2
    batches = [check_batch(model, rows=6, length=20, seed=s) for s in (11, 12)]
    return model.eval(), cfg, batches


def world_main(argv: list[str]) -> None:
    """One rank of `--layout`: start from the model or `--resume` checkpoint, take step `--step`
    on its batch, then rank 0 saves the checkpoint to `--save`."""
    from node.rl.parallel.dims import parse_layout
    from node.rl.parallel.world import Leader, follow

    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", required=True)
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--resume", type=Path)
    ap.add_argument("--save", type=Path)
    ap.add_argument("--leader-dies", action="store_true", help="rank 0 SIGKILLs itself once every rank started")
    args = ap.parse_args(argv)
    model, cfg, batches = _check_setup()
    dims = parse_layout(args.layout)
    if int(os.environ["RANK"]) > 0:
        follow(dims, cfg, SEED, model)
        return
    leader = Leader.connect(dims, cfg, SEED)
    try:
        leader.start(Trainer.load(args.resume, cfg) if args.resume else Trainer(model, cfg))
        if args.leader_dies:
            os.kill(os.getpid(), signal.SIGKILL)
        leader.train_step(batches[args.step - 1])
        leader.save(args.save)
    finally:
        leader.stop()


def _world(*args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", PYTHONPATH=_pythonpath())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_world_checkpoint_resumes_in_another_layout_to_the_one_process_step(tmp_path):
    _world("--layout", "dp2-ep2", "--step", "1", "--save", str(tmp_path / "s1"))
    _world("--layout", "cp2", "--step", "2", "--resume", str(tmp_path / "s1"), "--save", str(tmp_path / "s2"))
    model, cfg, batches = _check_setup()
    one = Trainer(model, cfg)
    for step, batch in enumerate(batches):
        before = {n: t.clone() for n, t in state_dict_to_hf(one.model).items()}
        torch.manual_seed(minibatch_seed(SEED, step))
        one.train_step(batch)
        saved = Trainer.load(tmp_path / f"s{step + 1}", cfg)
        assert saved.distributed_checkpoint is not None  # sharded: each rank wrote only its part
        saved.load_pending_optimizer_state()
        assert saved.step == one.step == step + 1
        errors = step_errors(state_dict_to_hf(saved.model), state_dict_to_hf(one.model), before)
        assert max(errors.values()) < STEP_TOLERANCE, (step, sorted(errors.items(), key=lambda kv: -kv[1])[:3])
        # the AdamW moments the distributed trainer saved are the one-process ones
        mine = {n: p for n, p in saved.model.named_parameters()}
        for name, p in one.model.named_parameters():
            want, got = one.optimizer.state[p], saved.optimizer.state[mine[name]]
            assert float(got["step"]) == float(want["step"]) == cfg.updates_per_batch * cfg.minibatches * (step + 1)
            scale = want["exp_avg_sq"].abs().max().clamp(min=1e-30)
            assert float((got["exp_avg_sq"] - want["exp_avg_sq"]).abs().max() / scale) < 1e-3, name



def test_a_dead_rank_0_never_leaves_a_rank_waiting(tmp_path):
    """Without torchrun to clean up (a lost node of a multi-node job): rank 1 sees rank 0 gone and
    raises `LeaderLost` instead of waiting for an order forever."""
    from node.sim_procs import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", PYTHONPATH=_pythonpath(), MASTER_PORT=str(free_port()),
               WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    cmd = [sys.executable, __file__, "--layout", "dp2-ep2", "--step", "1", "--leader-dies"]
    t0 = time.time()
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == -signal.SIGKILL
    assert procs[1].returncode not in (0, None) and "LeaderLost" in outs[1][1], outs[1][1][-2000:]
    assert time.time() - t0 < 60


if __name__ == "__main__":
    world_main(sys.argv[1:])


def _pythonpath() -> str:
    """The repository first: a worker run as a script has its own folder as sys.path[0], not the root
    (benchmarks.parallel_parity, which the workers import, is not an installed package)."""
    return os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
