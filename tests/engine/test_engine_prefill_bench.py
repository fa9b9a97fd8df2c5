"""`python -m benchmarks.engine_prefill` runs what the engine runs and says what padding costs."""

import json

import pytest

from benchmarks import engine_prefill


def test_engine_prefill_benchmark_times_both_ways_on_the_rl_tasks_prompts(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "r.json"
    assert engine_prefill.main(["--rows", "16", "--repeat", "1", "--out", str(out)]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got == json.loads(out.read_text())
    assert got["shape"] == "qwen3-moe-tiny" and got["rows"] == 16 and got["task"] == "reverse-text-long"
    assert got["padded_tokens"] >= got["prompt_tokens"] > 16 and got["padded_tokens_over_real"] >= 1
    assert got["packed_ms"] > 0 and got["padded_ms"] > 0 and got["packed_tok_s"] > 0
