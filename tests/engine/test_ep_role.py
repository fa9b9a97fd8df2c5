"""The inference role's expert-parallel engine (`builtin-ep`, `join --role inference --ep N`): rank 0
built through the registry starts rank 1 as `join` does, and the pair (gloo, CPU) serves what the
built-in engine serves, switching versions together; the real validator accepts its rollouts; a rank
that dies stops rank 0 with a typed error, and a rank 0 that dies ends its ranks."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from node.engine import registry as engines
from node.engine.registry import EngineSetup, EngineUnavailable
from node.model import CausalLM, ModelConfig

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("ep_role_worker.py")


def _worker(tmp_path: Path, mode: str, timeout: float = 120) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(WORKER), str(out), mode], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    return (json.loads(out.read_text()) if out.exists() else {}), proc


def test_ep2_role_engine_serves_the_builtin_engines_tokens_and_the_validator_accepts_them(tmp_path):
    got, proc = _worker(tmp_path, "serve")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert got["served"] == [4, 4]  # attention data-parallel: each rank served its own sequences
    assert got["tokens_equal"] and got["versions_equal"], got
    assert got["versions"] == [0, 1]  # version 1 switched in mid-generation, on both ranks at the same step
    assert got["logprob_max_diff"] < 1e-4 and got["hidden_max_diff"] < 1e-4, got
    assert got["routes_equal"]
    assert all(accepted for accepted, _, _ in got["verdicts"]) and len(got["verdicts"]) == 8, got["verdicts"]
    assert "shape" in got["refused"] and got["after_refused"]  # a misfit version changed nothing on any rank
    assert got["exit_codes"] == {"1": 0}  # rank 1 left on the stop order
    assert got["after_close"] == "EPWorldStopped"  # a step after close() is a typed error, not a hang


def test_a_rank_that_dies_mid_run_stops_rank_0_with_a_typed_error(tmp_path):
    got, proc = _worker(tmp_path, "rank-dies")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert got["error"] and got["error"].startswith("EPRankLost: expert-parallel world of 2 broken (rank 1 exited with code -9)"), got
    assert got["error_after_s"] < 30 and got["close_s"] < 30, got
    assert got["exit_codes"] == {"1": -9}


def test_a_rank_that_fails_at_start_fails_the_engine_start_at_once(tmp_path):
    got, proc = _worker(tmp_path, "rank-fails-at-start")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert got["error"].startswith("EngineUnavailable: expert-parallel rank 1 exited (code 5)"), got
    assert got["error_after_s"] < 30  # not the rendezvous timeout (300 s)
    assert got["exit_codes"] == {"1": 5}


def _gone(pid: int) -> bool:
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True


def test_ranks_leave_when_rank_0_is_killed(tmp_path):
    got, proc = _worker(tmp_path, "leader-dies")
    assert proc.returncode == -9
    t = time.time()
    while not _gone(got["follower_pid"]) and time.time() - t < 30:
        time.sleep(0.2)
    assert _gone(got["follower_pid"]), "rank 1 outlived its rank 0"


def _setup(tmp_path: Path, model: CausalLM, **kw) -> EngineSetup:
    cfg = model.config
    return EngineSetup(model=lambda: copy.deepcopy(model), hf_config=cfg.to_hf_dict(), max_batch=4,
                       max_seq_len=cfg.max_position_embeddings, eos_id=-1, encode=list, decode=str, bos_id=1,
                       capture_experts=True, workdir=tmp_path, salt="run", **kw)


def test_settings_builtin_ep_cannot_serve_are_refused_before_any_process_starts(tmp_path):
    torch.manual_seed(0)
    moe = CausalLM(ModelConfig(vocab_size=64, hidden_size=32, moe_intermediate_size=32, head_dim=8, num_experts=8))
    assert engines.entry("builtin-ep").claims == "builtin"  # the validator verifies it as the built-in engine
    assert engines.check("builtin-ep", _setup(tmp_path, moe, ep=2)) == {"ep": 2, "device": "cpu"}
    with pytest.raises(EngineUnavailable, match="must divide the model's 8 experts"):
        engines.check("builtin-ep", _setup(tmp_path, moe, ep=3))
    with pytest.raises(EngineUnavailable, match="use --engine builtin-ep"):
        engines.check("builtin", _setup(tmp_path, moe, ep=2))
    with pytest.raises(EngineUnavailable, match="use --engine builtin-ep"):
        engines.check("builtin-cuda", _setup(tmp_path, moe, ep=2))
    with pytest.raises(EngineUnavailable, match="FP8"):
        engines.check("builtin-ep", _setup(tmp_path, moe, ep=2, fp8="experts"))
    with pytest.raises(EngineUnavailable, match=">= 2"):
        engines.check("builtin-ep", _setup(tmp_path, moe, ep=1))
    dense = CausalLM(ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8,
                                 num_experts=0))
    with pytest.raises(EngineUnavailable, match="dense"):
        engines.check("builtin-ep", _setup(tmp_path, dense, ep=2))


@pytest.mark.slow
def test_sim_with_an_ep2_inference_node_trains_on_rollouts_the_validator_accepted(tmp_path):
    """Every role a real OS process: the only inference node is `join --role inference --ep 2` (rank 0
    starts rank 1 itself); its rollouts are verified (100%) as the built-in engine's and trained on."""
    from node.sim import run_sim

    s = run_sim(tmp_path, inference_nodes=1, steps=3, batch_groups=4, group_size=4, inference_ep=2)
    assert s["status"] == "done" and s["steps"] == 3, s
    assert s["rollouts_trained"] == 3 * 4 * 4 and s["rollouts_rejected"] == 0 and s["honest_banned"] == 0, s
    assert s["rollouts_lost"] == 0 and s["rollouts_duplicated"] == 0
    assert all(code == 0 for code in s["exit_codes"].values()), s["exit_codes"]
    log = (tmp_path / "inference-0" / "log.txt").read_text()
    assert "expert-parallel rank 0 of 2: leading" in log
    served = json.loads(log.split("requests served per rank ")[1].splitlines()[0])
    # rank 1 served its share: each request goes to the rank with the fewest in flight, so the totals differ
    # by how unevenly sequences finish ([36, 32] on a loaded 2-core machine), not by one
    assert served[1] > 0 and min(served) >= sum(served) // 4, served
    rank1 = (tmp_path / "inference-0" / "ep-rank-1.log").read_text()
    assert "following rank 0" in rank1 and "stop from rank 0" in rank1  # it served, then left on the stop order
    rounds = [json.loads(x) for x in (tmp_path / "inference-0" / "rounds.jsonl").read_text().splitlines()]
    assert sum(r["groups"] for r in rounds) >= 3 * 4


def test_join_refuses_an_ep_that_does_not_divide_the_experts_or_an_engine_that_cannot_before_starting_ranks(tmp_path, capsys):
    from node.run_config import RunConfig, to_toml
    from node.sim_procs import free_port
    from protocol.identity import NodeKey

    (tmp_path / "run.toml").write_text(to_toml({  # tiny-moe with the recipe's 4 experts
        "run_id": "t1", "task": "reverse", "trainer": NodeKey.from_seed(b"t" * 32).peer_id,
        "validators": [NodeKey.from_seed(b"v" * 32).peer_id], "listen": f"/ip4/127.0.0.1/tcp/{free_port()}"}))
    (tmp_path / "spec.json").write_text(RunConfig.load(tmp_path / "run.toml").run_spec("12D3KooWcoord").model_dump_json())
    from node.cli import main

    for flags, said in ((["--ep", "3"], "--ep 3 must divide the model's 4 experts"),
                        (["--ep", "2", "--engine", "builtin"], "engine builtin cannot serve expert-parallel (--ep 2)")):
        code = main(["join", "--role", "inference", "--bootstrap", "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWcoord",
                     "--spec", str(tmp_path / "spec.json"), "--workdir", str(tmp_path / "w"), *flags])
        err = capsys.readouterr().err
        assert code == 2 and said in err and "Traceback" not in err, err[-2000:]  # one line, before any rank starts
        assert not list((tmp_path / "w").glob("ep-rank-*.log")) and "RANK" not in os.environ


def test_rank_0_sends_keepalives_only_while_it_sends_no_orders():
    from node.distributed.control import KeepAlive

    every = 0.2
    sent: list[float] = []
    # each keep-alive's time as KeepAlive set it just before sending (a preempted thread cannot skew it)
    keep = KeepAlive(lambda: sent.append(keep._last), every_s=every)
    try:
        orders, end = [], time.monotonic() + 0.6
        while time.monotonic() < end:  # orders going out every 50 ms: no keep-alive needed
            orders.append(time.monotonic())
            keep.sent()
            time.sleep(0.05)
        # a loaded machine may oversleep by more than `every`: a keep-alive is then due, so the claim
        # is checked on the gaps that really happened
        if max(b - a for a, b in zip(orders, [*orders[1:], time.monotonic()])) < every:
            assert sent == []
        idle, before = time.monotonic(), len(sent)
        while len(sent) < before + 3:  # idle: one about every 0.2 s (waits on them, however slow)
            assert time.monotonic() - idle < 60, sent
            time.sleep(0.05)
        beats = [orders[-1], *sent[before:]]
        assert all(b - a >= every for a, b in zip(beats, beats[1:])), beats  # never more often than every_s
    finally:
        keep.close()
    n = len(sent)
    time.sleep(0.4)
    assert len(sent) == n  # closed: no more
