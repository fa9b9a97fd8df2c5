"""A trainer checkpoint is written whole or not at all (`node.model.checkpoint.written_whole`): a write that fails
(here the process's real file-size limit, as a full disk fails it) leaves the previous checkpoint as it was and
nothing of the new one; a checkpoint its filesystem has no room for is refused before anything is written; a swap a
crash cut is finished on the next start."""

from __future__ import annotations

import json
import resource
import shutil
import signal

import pytest
import torch

from node.model.checkpoint import CheckpointDoesNotFit, CheckpointNotWritten, recover, written_whole
from node.model.config import ModelConfig
from node.model.qwen3_moe import CausalLM
from node.rl.batch import build_batch
from node.rl.trainer import Trainer, TrainerConfig
from node.envs.base import Task
from node.envs.rollout import Rollout


def _trained(steps: int) -> tuple[Trainer, object]:
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=48, hidden_size=32, moe_intermediate_size=32, head_dim=8)
    trainer = Trainer(CausalLM(cfg), TrainerConfig(updates_per_batch=1, minibatches=1))
    ids = [3, 4, 5, 6, 7, 8]
    batch = build_batch([Rollout("e", Task("t", "", ""), ids[:3], ids[3:], [True] * 3, [-3.0] * 3, [0] * 3)], [1.0])
    for _ in range(steps):
        trainer.train_step(batch)
    return trainer, batch


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_a_failed_write_keeps_the_previous_checkpoint_whole_and_leaves_nothing_of_the_new(tmp_path):
    trainer, batch = _trained(1)
    ckpt = tmp_path / "checkpoint"
    trainer.save(ckpt)
    saved = _weights(trainer)
    trainer.train_step(batch)
    assert trainer.step == 2
    # the kernel refuses writes past 64 KiB in this process (EFBIG, as ENOSPC on a full disk): the weights
    # file is larger, so the second checkpoint fails part-way through its first file
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        with pytest.raises(CheckpointNotWritten, match="previous one is kept"):
            trainer.save(ckpt)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"], "a partial checkpoint was left"
    assert json.loads((ckpt / "trainer.json").read_text())["step"] == 1
    resumed = Trainer.load(ckpt)
    assert resumed.step == 1
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    trainer.save(ckpt)  # room again: the new one replaces it
    assert Trainer.load(ckpt).step == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]


def test_a_checkpoint_with_no_room_is_refused_before_anything_is_written(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(CheckpointDoesNotFit, match=r"needs [\d.]+ GiB, [\d.]+ GiB free"):
        with written_whole(tmp_path / "checkpoint", free + (1 << 30)):
            raise AssertionError("the block ran")
    assert list(tmp_path.iterdir()) == []
    with written_whole(tmp_path / "checkpoint", 1 << 20) as staging:  # the same call with room: written
        (staging / "trainer.json").write_text("{}")
    assert (tmp_path / "checkpoint" / "trainer.json").exists()


@pytest.mark.parametrize("cut", ["after moving the previous aside", "before removing the previous",
                                 "while writing"])
def test_a_swap_a_crash_cut_is_finished_on_the_next_start(tmp_path, cut):
    ckpt, previous, staging = (tmp_path / n for n in ("checkpoint", "checkpoint.previous", "checkpoint.partial"))
    for d, step in ((previous, 1), (staging, 2)):
        d.mkdir()
        (d / "trainer.json").write_text(json.dumps({"step": step}))
    if cut == "before removing the previous":
        staging.rename(ckpt)
    elif cut == "while writing":
        previous.rename(ckpt)
    recover(ckpt)
    want = {"after moving the previous aside": 1, "before removing the previous": 2, "while writing": 1}[cut]
    assert json.loads((ckpt / "trainer.json").read_text())["step"] == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]


def _resumes_where_it_trains(tmp_path, device: str, dtype: torch.dtype) -> Trainer:
    """A trainer checkpoint resumed on `device` in `dtype` (the trainer role resumes in the run's dtype on its
    own device): the weights, the AdamW moments and the step count beside each parameter as the optimizer keeps
    them, and a step taken there from the saved state."""
    trainer, batch = _trained(1)
    ckpt = tmp_path / "checkpoint"
    trainer.save(ckpt)
    resumed = Trainer.load(ckpt, device=device, dtype=dtype)
    before = _weights(resumed)
    for p in resumed.model.parameters():
        assert (p.device.type, p.dtype) == (device, dtype)
        state = resumed.optimizer.state[p]
        assert (state["exp_avg"].device.type, state["exp_avg"].dtype) == (device, dtype)
        assert float(state["step"]) == 1.0
    resumed.train_step(batch)
    assert resumed.step == 2
    for p in resumed.model.parameters():
        assert float(resumed.optimizer.state[p]["step"]) == 2.0
    assert any(not torch.equal(v, before[k]) for k, v in resumed.model.state_dict().items()), "the step moved nothing"
    return resumed


def test_a_trainer_resumes_in_the_runs_dtype(tmp_path):
    """Before, a resumed trainer always came back on the CPU in float32, whatever the run's dtype and device."""
    assert not _resumes_where_it_trains(tmp_path, "cpu", torch.bfloat16).fused


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_trainer_resumes_on_the_gpu_with_its_fused_optimizer(tmp_path):
    resumed = _resumes_where_it_trains(tmp_path, "cuda", torch.bfloat16)
    assert resumed.fused and resumed.optimizer.param_groups[0]["fused"]
    # the fused kernel reads the step count on the device
    assert all(resumed.optimizer.state[p]["step"].is_cuda for p in resumed.model.parameters())
