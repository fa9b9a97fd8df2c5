"""The rendered Slurm jobs, submitted for real: a two-node Slurm cluster on this host (one slurmctld,
two slurmd; contrib/slurm/local_cluster.py) runs the 2-node-shaped layout (one trainer node, one
inference node) against a coordinator, and the run trains. Skips where Slurm is not installed
(.ci/run installs Debian's slurmctld, slurmd and slurm-client)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from contrib.slurm import local_cluster
from contrib.slurm.local_cluster import LocalSlurm
from contrib.slurm.render import ClusterLayout, render
from node.run_config import to_toml
from node.sim_procs import Proc, free_port, wait_for
from protocol.identity import NodeKey

pytestmark = pytest.mark.skipif(local_cluster.available() is not None, reason=str(local_cluster.available()))

STEPS = 3


def _launch_coordinator(tmp: Path, trainer: NodeKey, origin_port: int) -> tuple[Proc, str]:
    cfg = {"run_id": "slurm-reverse", "task": "reverse", "batch_groups": 4, "group_size": 4,
           "max_off_policy_steps": 1, "verification_rate": 0.0, "heartbeat_interval_s": 2.0,
           "dead_after_missed": 3, "lease_ttl_s": 60.0, "shardcast_sources": [f"http://127.0.0.1:{origin_port}"],
           "trainer": trainer.peer_id, "validators": [], "listen": f"/ip4/127.0.0.1/tcp/{free_port()}",
           "status_port": free_port(), "recipe": {"steps": STEPS, "seed": 0}}
    state = tmp / "coordinator"
    state.mkdir()
    (tmp / "run.toml").write_text(to_toml(cfg))
    coord = Proc("coordinator", ["coordinator", "launch", "--config", str(tmp / "run.toml"), "--state", str(state),
                                 "--addr-file", str(state / "addr")], state / "log.txt")
    coord.start()
    return coord, wait_for(state / "addr", coord, 60).splitlines()[0]


def test_two_node_layout_trains_when_submitted_to_a_slurm_cluster(tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    trainer_key = NodeKey.generate()
    trainer_key.save(keys / "trainer.key")
    origin = free_port()
    coord, bootstrap = _launch_coordinator(tmp_path, trainer_key, origin)
    layout = ClusterLayout(name="local", partition="local", gpus_per_node=0, cpu_procs_per_node=1, trainer_nodes=1,
                           inference_nodes=1, dp=1, ep=1, cp=1, engine="builtin",
                           spec=str(tmp_path / "coordinator" / "spec.json"), bootstrap=bootstrap,
                           state_dir=str(tmp_path / "state"), key_dir=str(keys), log_dir=str(tmp_path),
                           shardcast_port=origin, bind_host="127.0.0.1", rdzv_port=free_port(),
                           time_limit="00:10:00")
    trainer_job, inference_job = render(layout, tmp_path / "jobs")
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    try:
        with LocalSlurm(tmp_path / "cluster", nodes=2) as cluster:
            t_id = cluster.sbatch(trainer_job, "--chdir", str(tmp_path), env=env)
            i_id = cluster.sbatch(inference_job, "--chdir", str(tmp_path), env=env)
            try:
                # The trainer exits by itself after its last step; the inference fleet runs until cancelled.
                t_state = cluster.wait(t_id, lambda s: s not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"), 240)
                i_running = cluster.state(i_id)
                cluster.cancel(i_id)
                i_state = cluster.wait(i_id, lambda s: s not in ("RUNNING", "COMPLETING"), 60)
            finally:
                cluster.cancel(t_id, kill=True)
                cluster.cancel(i_id, kill=True)
    finally:
        coord.stop()
    logs = {p.name: p.read_text(errors="replace") for p in tmp_path.glob("local-*.out")}
    assert t_state == "COMPLETED", logs
    # the fleet either still serves (then scancel stops it) or has already left by itself: at the run's
    # last step the coordinator announces the end and every member exits 0 (RunEnd)
    assert i_running in ("RUNNING", "COMPLETING", "COMPLETED") and i_state in ("CANCELLED", "COMPLETED"), \
        (i_running, i_state, logs)
    metrics = [json.loads(x) for x in (tmp_path / "state" / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(len(m["work_ids"]) == 4 for m in metrics)  # batch_groups work units, every step
    inference_log = next(text for name, text in logs.items() if "inference" in name)
    assert "node id:" in inference_log and (tmp_path / "keys" / "inference-0.key").exists()  # own key per node
    assert "groups submitted" in inference_log  # it stopped cleanly on scancel's SIGTERM
