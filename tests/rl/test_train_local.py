import json
import subprocess
import sys

import pytest

from node.train_local import LocalRunConfig, run
from node.rl.trainer import TrainerConfig


@pytest.mark.slow(seconds=60)
def test_train_local_learns_reversal(tmp_path):
    """A short version of the README's run: reward rises from <= 0.3 at the first RL step."""
    cfg = LocalRunConfig(task="reverse", steps=120, prompts=32, samples=8, seed=0,
                         trainer=TrainerConfig(decay_steps=120))
    metrics = run(cfg, tmp_path, progress=False)
    first = metrics[0]["reward_mean"]
    last5 = sum(m["reward_mean"] for m in metrics[-5:]) / 5
    assert first <= 0.3
    assert last5 >= 0.55, f"reward went {first:.3f} -> {last5:.3f}"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 120 and {"step", "reward_mean", "mismatch_kl", "tokens_per_s"} <= set(rows[0])
    assert max(abs(r["mismatch_kl"]) for r in rows) < 1e-4  # engine and trainer compute the same policy
    assert (tmp_path / "reward.png").stat().st_size > 1000
    assert (tmp_path / "checkpoint" / "model.safetensors").exists()


def test_unknown_task_is_refused_with_a_clear_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "node.cli", "train-local", "--task", "sort", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown task 'sort'" in proc.stderr and "Traceback" not in proc.stderr


def test_sample_lag_samples_from_the_policy_versions_behind(tmp_path):
    """--sample-lag 1 (a network run's off-policy lag in one process): from the second step on, the
    rollouts come from the version before the trainer's, so trainer and sampler disagree; at lag 0 they do not."""
    def kls(lag):
        cfg = LocalRunConfig(task="reverse", steps=3, prompts=4, samples=4, warmup_target=0.0, sample_lag=lag,
                             trainer=TrainerConfig(lr=3e-3, decay_steps=3, updates_per_batch=1, minibatches=1))
        return [m["mismatch_kl"] for m in run(cfg, tmp_path / f"lag{lag}", progress=False)]

    on, behind = kls(0), kls(1)
    assert max(abs(k) for k in on) < 1e-6 and abs(behind[0]) < 1e-6  # step 0: both sample version 0
    assert min(behind[1:]) > 1e-4  # measured 1e-3 to 1e-2
