"""`sim --mps`: one multi-process service daemon for the sim's GPU roles, started before them with its pipe directory
in each member's environment, told to quit after they stopped. This machine has no GPU and no NVIDIA driver: the
control program here is a named fake (`FAKE_CONTROL`, a shell script that records how it was called), standing in
for nvidia-cuda-mps-control, which the H200 runs use (benchmarks/results: `gpu_network ... --mps`)."""

from __future__ import annotations

import os

import pytest

from node.sim_mps import CONTROL, Mps, MpsUnavailable

FAKE_CONTROL = """#!/bin/sh
# a stand-in for nvidia-cuda-mps-control: records its arguments, pipe directory and input
{ echo "args:$*"; echo "pipe:$CUDA_MPS_PIPE_DIRECTORY"; if [ "$#" -eq 0 ]; then cat; fi; } >> "$MPS_RECORD"
[ "$1" = "-d" ] && echo "daemon started" > "$CUDA_MPS_LOG_DIRECTORY/control.log"
exit "${MPS_FAIL:-0}"
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / CONTROL).write_text(FAKE_CONTROL)
    (bin_dir / CONTROL).chmod(0o755)
    record = tmp_path / "record.txt"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("MPS_RECORD", str(record))
    return record


def test_the_daemon_starts_with_its_own_pipe_directory_and_quits_with_its_log_kept(fake_control, tmp_path):
    mps = Mps.start()
    pipe = mps.env["CUDA_MPS_PIPE_DIRECTORY"]
    assert len(pipe) < 100 and os.path.isdir(pipe)  # the socket path's limit is 108 bytes
    mps.stop(tmp_path / "mps-log")
    lines = fake_control.read_text().splitlines()
    assert lines == ["args:-d", f"pipe:{pipe}", "args:", f"pipe:{pipe}", "quit"]
    assert (tmp_path / "mps-log" / "control.log").read_text() == "daemon started\n"
    assert not os.path.exists(pipe)


def test_no_control_program_or_a_failing_one_is_a_clear_error(fake_control, monkeypatch, tmp_path):
    monkeypatch.setenv("MPS_FAIL", "1")
    with pytest.raises(MpsUnavailable, match="-d failed"):
        Mps.start()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(MpsUnavailable, match="not on PATH"):
        Mps.start()


def test_sim_mps_needs_roles_on_a_gpu(tmp_path):
    from node.sim import run_sim

    with pytest.raises(ValueError, match="needs roles on a GPU"):
        run_sim(tmp_path, inference_nodes=1, steps=1, batch_groups=2, group_size=2, timeout_s=60, mps=True)
    assert not (tmp_path / "coordinator").exists()  # refused before anything started


@pytest.mark.slow  # a network of processes: runs after the fast tests
def test_the_sim_starts_the_daemon_before_its_roles_gives_them_its_pipe_and_stops_it_after_them(fake_control, tmp_path):
    from node.sim_config import SimConfig
    from node.sim_devices import Placement
    from node.sim_network import start_network, stop_network

    net = start_network(tmp_path, SimConfig(inference_nodes=1, steps=3, batch_groups=2, group_size=2, timeout_s=300,
                                            mps=True, placement=Placement("cpu", "cpu", ("cuda:0",))))
    try:
        pipe = net.mps.env["CUDA_MPS_PIPE_DIRECTORY"]
        assert fake_control.read_text().splitlines() == ["args:-d", f"pipe:{pipe}"]  # before any role
        assert all(p.env["CUDA_MPS_PIPE_DIRECTORY"] == pipe for p in net.members.values())
    finally:
        stop_network(net, "stopped")
    assert fake_control.read_text().splitlines()[-1] == "quit"  # told to quit once the roles stopped
    assert (tmp_path / "mps-log" / "control.log").exists() and not os.path.exists(pipe)
