"""Any HF checkpoint of the supported architectures loads with transformers' numerics, and bad input
fails with a typed error naming the file or field, before anything is handed out."""

import json
import shutil

import pytest
import torch

from node.model import CausalLM, load_checkpoint, save_checkpoint
from node.model.errors import (MissingModelFile, ModelTooLarge, TokenizerMismatch, UnsupportedModelField,
                               UnsupportedModelType, WeightsHashMismatch)
from node.model.hf_config import _HF_DEFAULTS, config_from_hf
from node.model.spec import ModelSpec, check_fits, load_model

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


def _hf_model(kind: str, **extra):
    if kind == "llama":
        cfg = transformers.LlamaConfig(**SMALL, **extra)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**SMALL, **extra)
        cls = transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.Qwen3MoeConfig(**SMALL, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                          norm_topk_prob=True, **extra)
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # transformers initialises norms to 1 and some weights tiny: make every tensor matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _max_logit_diff(ours, hf, vocab=96) -> float:
    ids = torch.randint(0, vocab, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (ours(ids).logits - hf(ids).logits).abs().max().item()


@pytest.mark.parametrize("kind,shard", [("llama", None), ("llama", "20KB"), ("qwen3", None), ("qwen3", "20KB"),
                                        ("qwen3_moe", None), ("qwen3_moe", "20KB")])
def test_transformers_checkpoints_load_with_equal_logits(tmp_path, kind, shard):
    hf = _hf_model(kind, tie_word_embeddings=(kind == "llama"))
    hf.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard)
    ours = load_checkpoint(tmp_path).eval()
    assert ours.config.model_type == kind and ours.config.qk_norm == (kind != "llama")
    assert _max_logit_diff(ours, hf) <= 1e-4


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    hf = _hf_model("llama", rope_scaling=scaling, rope_theta=500000.0)
    hf.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path).eval()
    assert ours.config.rope_scaling.rope_type == "llama3"
    assert _max_logit_diff(ours, hf) <= 1e-4
    plain = json.loads((tmp_path / "config.json").read_text())
    plain.pop("rope_parameters", None), plain.pop("rope_scaling", None)
    (tmp_path / "config.json").write_text(json.dumps({**plain, "rope_theta": 500000.0}))
    assert _max_logit_diff(load_checkpoint(tmp_path).eval(), hf) > 1e-3  # the schedule is really applied


def test_our_saved_checkpoints_open_in_transformers_sharded_with_tokenizer(tmp_path):
    hf = _hf_model("llama", tie_word_embeddings=True)
    hf.save_pretrained(tmp_path / "src")
    (tmp_path / "src" / "tokenizer.json").write_text("{}")  # companions travel byte for byte
    ours = load_checkpoint(tmp_path / "src").eval()
    save_checkpoint(ours, tmp_path / "out", companions_from=tmp_path / "src", max_shard_bytes=40_000)
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert _max_logit_diff(ours, back) <= 1e-5
    again = load_checkpoint(tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))


def test_absent_fields_mean_what_transformers_means():
    for kind, cls in (("llama", transformers.LlamaConfig), ("qwen3", transformers.Qwen3Config),
                      ("qwen3_moe", transformers.Qwen3MoeConfig)):
        d = cls().to_dict()
        for name, value in _HF_DEFAULTS[kind].items():
            hf_name = "num_local_experts" if name == "num_experts" and name not in d else name
            assert d[hf_name] == value, (kind, name)


def test_unknown_model_type_and_fields_are_refused_by_name():
    base = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4}
    assert config_from_hf(base).num_experts == 0
    with pytest.raises(UnsupportedModelType, match="'mistral'"):
        config_from_hf({**base, "model_type": "mistral"})
    with pytest.raises(UnsupportedModelField, match="'logit_softcap'"):
        config_from_hf({**base, "logit_softcap": 30.0})
    with pytest.raises(UnsupportedModelField, match="mlp_bias=True"):
        config_from_hf({**base, "mlp_bias": True})
    with pytest.raises(UnsupportedModelField, match="rope_type 'yarn'"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(UnsupportedModelField, match="quantization_config"):
        config_from_hf({**base, "quantization_config": {"quant_method": "gguf"}})
    with pytest.raises(UnsupportedModelField, match="use_sliding_window"):
        config_from_hf({**base, "model_type": "qwen3", "use_sliding_window": True})


def test_missing_files_are_named(tmp_path):
    hf = _hf_model("qwen3")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(MissingModelFile, match=shard.name):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(MissingModelFile, match="model.safetensors"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(MissingModelFile, match="config.json"):
        load_checkpoint(tmp_path)
    _hf_model("qwen3").save_pretrained(tmp_path)  # complete weights, but no tokenizer files
    with pytest.raises(MissingModelFile, match="tokenizer.json"):
        load_model(ModelSpec(source=str(tmp_path)))


def test_spec_checks_hash_tokenizer_and_memory(tmp_path, monkeypatch):
    tiny = load_model(ModelSpec())
    assert tiny.weights_hash.startswith("blake3:")
    assert load_model(ModelSpec(weights_hash=tiny.weights_hash)).weights_hash == tiny.weights_hash
    with pytest.raises(WeightsHashMismatch, match="blake3:0000"):
        load_model(ModelSpec(weights_hash="blake3:" + "0" * 64))
    with pytest.raises(ModelTooLarge, match="GiB"):
        check_fits(tiny.model.config, "float32", "cpu", copies=4, available=1000)
    import node.model.spec as spec_module

    def no_weights(*a, **k):
        raise AssertionError("weights read before the memory check")

    monkeypatch.setattr(spec_module, "available_memory", lambda device: 1000)
    monkeypatch.setattr(spec_module, "CheckpointShards", no_weights)
    with pytest.raises(ModelTooLarge):
        load_model(ModelSpec())
    monkeypatch.undo()
    smol = pytest.importorskip("node.model.pretrained")
    try:
        tok_dir = smol.smollm2_dir()
    except smol.PretrainedUnavailable as exc:
        pytest.skip(str(exc))
    _hf_model("llama").save_pretrained(tmp_path)  # vocab 96 against a 49,152-token tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(tok_dir / name, tmp_path / name)
    with pytest.raises(TokenizerMismatch, match="49152 ids.*vocab_size.*96"):
        load_model(ModelSpec(source=str(tmp_path)))
