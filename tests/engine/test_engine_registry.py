"""The inference role's engines by name: `builtin-cuda` (CudaEngine) is built through the registry with
the node's device and FP8 choice, and settings an engine cannot honour are refused before it starts."""

import copy
from pathlib import Path

import pytest
import torch

from node.engine import Engine, Request, RequestTooLong, SamplingParams
from node.engine import registry as engines
from node.engine.cuda_engine import CudaEngine
from node.engine.registry import EngineSetup, EngineUnavailable
from node.model import CausalLM, ModelConfig


def setup(tmp_path: Path, model: CausalLM, **kw) -> EngineSetup:
    cfg = model.config
    return EngineSetup(model=lambda: copy.deepcopy(model), hf_config=cfg.to_hf_dict(), max_batch=4,
                       max_seq_len=cfg.max_position_embeddings, eos_id=-1, encode=list, decode=str, bos_id=1,
                       capture_experts=True, workdir=tmp_path, salt="run", **kw)


def tiny() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(ModelConfig(vocab_size=64, hidden_size=32, moe_intermediate_size=32, head_dim=8)).eval()


def test_builtin_cuda_engine_is_built_by_name_and_samples_as_the_builtin_one(tmp_path):
    model = tiny()
    s = setup(tmp_path, model, device="cpu")
    assert engines.check("builtin-cuda", s) == {"device": "cpu", "fp8": "off"}
    assert engines.entry("builtin-cuda").claims == "builtin"  # the validator re-derives its sampling
    built = engines.build("builtin-cuda", s)
    assert isinstance(built, CudaEngine)
    reqs = [Request(str(i), [3 + i, 5, 7], SamplingParams(temperature=0.9, max_new_tokens=5, seed=i)) for i in range(6)]
    ref = Engine(copy.deepcopy(model), max_batch=4, eos_id=-1).generate(reqs)
    got = built.generate(reqs)
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]


def test_engine_settings_it_cannot_honour_are_refused_before_start(tmp_path):
    model = tiny()
    with pytest.raises(EngineUnavailable, match="builtin-cuda"):
        engines.check("builtin", setup(tmp_path, model, device="cuda"))
    with pytest.raises(EngineUnavailable, match="fp8"):
        engines.check("builtin-cuda", setup(tmp_path, model, device="cpu", fp8="int4"))
    with pytest.raises(EngineUnavailable, match="block-scaled FP8"):  # vLLM's FP8 is not the validator's
        engines.check("vllm", setup(tmp_path, model, fp8="experts"))
    assert engines.check("builtin", setup(tmp_path, model)) == {}


def test_builtin_cpu_engine_serves_the_runs_fp8_and_loads_new_versions_into_it(tmp_path):
    from node.engine.fp8.model import fp8_mode_of

    model = tiny()
    s = setup(tmp_path, model, fp8="all")
    assert engines.check("builtin", s) == {"fp8": "all"}
    built = engines.build("builtin", s)
    assert fp8_mode_of(built.model) == "all" and fp8_mode_of(model) == "off"
    reqs = [Request(str(i), [3 + i, 5, 7], SamplingParams(temperature=0.0, max_new_tokens=6)) for i in range(4)]
    before = built.generate(reqs)
    newer = {k: v * 1.5 for k, v in model.state_dict().items()}
    built.load_weights(newer, version=1)
    after = built.generate(reqs)
    assert {v for c in after for v in c.versions} == {1}
    assert [c.logprobs for c in after] != [c.logprobs for c in before]  # the FP8 buffers took version 1
    assert torch.allclose(built.model.state_dict()["model.layers.0.mlp.experts.down_proj"],
                          newer["model.layers.0.mlp.experts.down_proj"], rtol=0.07, atol=1e-3)


def test_fp8_follows_the_run_spec_and_a_differing_flag_is_refused():
    assert engines.serving_fp8("experts", None) == "experts" and engines.serving_fp8("off", None) == "off"
    assert engines.serving_fp8("all", "all") == "all"
    with pytest.raises(engines.FP8Mismatch, match="model.fp8"):
        engines.serving_fp8("off", "experts")
    with pytest.raises(engines.FP8Mismatch, match="drop --fp8"):
        engines.serving_fp8("experts", "off")


def test_every_registered_engine_is_built_one_way_and_has_the_whole_inference_engine_surface(tmp_path):
    import typing

    from node.plugins import resolve

    surface = set(typing.get_type_hints(engines.InferenceEngine)) | {
        n for n, v in vars(engines.InferenceEngine).items() if callable(v) and not n.startswith("_")}
    assert surface == {"max_seq_len", "add_request", "has_work", "step", "generate", "load_weights", "close"}
    for name, e in engines.ENGINES.items():
        cls = resolve(e.path)
        assert callable(cls.from_setup), name  # registry.build's one construction path
        assert all(callable(getattr(cls, m)) for m in surface - {"max_seq_len"}), name
    model = tiny()
    for name in ("builtin", "builtin-cuda"):
        s = setup(tmp_path, model, device="cpu")
        s.max_seq_len = 16  # the node's bound, not the model's 512 positions
        built = engines.build(name, s)
        assert built.max_seq_len == 16 and built.version == -1
        with pytest.raises(RequestTooLong):
            built.add_request(Request("long", list(range(16))))
        done = built.generate([Request("r", [3, 5, 7], SamplingParams(temperature=0.0, max_new_tokens=100))])
        assert done[0].finish_reason == "length" and len(done[0].prompt_ids) + len(done[0].token_ids) == 16
        engines.close(built)
