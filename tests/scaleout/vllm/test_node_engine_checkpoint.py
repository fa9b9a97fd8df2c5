"""Each policy version a vLLM inference node writes is a whole HF checkpoint: config, weights and the
run's tokenizer files (the node's EngineSetup names the model directory); vLLM is told to sample with
its neutral defaults, never a checkpoint's generation_config.json. Needs no vLLM."""

from __future__ import annotations

import json

import pytest
import torch

from contrib.vllm.node_engine import write_hf_checkpoint
from contrib.vllm.settings import VLLMSettings, server_args
from node.model import load_checkpoint
from node.model.checkpoint import state_dict_to_hf

transformers = pytest.importorskip("transformers")


def test_a_written_version_carries_the_tokenizer_files_and_loads(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, head_dim=16, max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "src")
    for name, text in [("tokenizer.json", '{"t": 1}'), ("tokenizer_config.json", '{"c": 2}'),
                       ("chat_template.jinja", "{{ messages }}")]:
        (tmp_path / "src" / name).write_text(text)
    model = load_checkpoint(tmp_path / "src")
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # a later version
    out = write_hf_checkpoint(state_dict_to_hf(model), model.config.to_hf_dict(), tmp_path / "vllm" / "v3",
                              companions_from=tmp_path / "src")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (tmp_path / "src" / name).read_bytes(), name
    assert torch.equal(load_checkpoint(out).lm_head.weight, model.lm_head.weight)
    assert not (tmp_path / "vllm" / "v3.tmp").exists()
    bare = write_hf_checkpoint(state_dict_to_hf(model), model.config.to_hf_dict(), tmp_path / "vllm" / "v4")
    assert sorted(p.name for p in bare.iterdir()) == ["config.json", "model.safetensors"]  # tiny-moe: no tokenizer
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 256


def test_vllm_samples_with_its_neutral_defaults_not_the_checkpoints():
    args = server_args(VLLMSettings(model="/m"), 8000)
    assert args[args.index("--generation-config") + 1] == "vllm"
