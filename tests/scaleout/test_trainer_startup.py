"""A trainer world of 4 ranks (gloo, dp = ep = 4, FSDP2) starts from an HF checkpoint with every rank
reading only its own parameter rows: its shards are the one-process model's, and its peak RSS stays
under the issue's bound 1.5 x (model bytes / world) + 2 GiB (benchmarks/trainer_startup.py)."""

from __future__ import annotations

from benchmarks.trainer_startup import main


def test_each_rank_reads_only_its_own_shards_and_stays_within_the_memory_bound(tmp_path):
    result = main(["--tiny", "--layers", "2", "--world", "4", "--check", "--scratch", str(tmp_path), "--timeout", "300"])
    assert result["mismatched"] == []  # every rank's shards equal the one-process model's part
    assert len(result["peak_rss_gib_per_rank"]) == 4
    assert max(result["peak_rss_gib_per_rank"]) <= result["bound_per_rank_gib"]
    # the ranks' parameters together are the model once (no rank holds more than its share)
    assert result["local_param_bytes_total"] == result["model_bytes"]
    assert not list(tmp_path.iterdir())  # the scratch checkpoint is gone
