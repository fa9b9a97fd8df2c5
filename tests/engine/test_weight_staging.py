"""A policy version goes into a served model tensor by tensor: experts into their rows of the stacked
tensors, FP8 modules quantised on arrival, from the payload's mapping without a host copy of the model,
and a refused version changes nothing."""

import copy

import numpy as np
import pytest
import torch

from node.engine import Engine, Request, SamplingParams
from node.engine.fp8.model import apply_fp8_mode
from node.engine.weights import WeightsMismatch
from node.fp8.quantize import quantize_weight
from node.model import CausalLM, ModelConfig
from node.model.checkpoint import state_dict_to_hf
from protocol.identity import NodeKey
from shardcast.fetch import read_held
from shardcast.manifest import TrustedPublishers
from shardcast.publish import publish
from shardcast.store import Store


def tiny(seed=0, **kw) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(ModelConfig(vocab_size=64, hidden_size=128, moe_intermediate_size=128, head_dim=32,
                                **kw)).eval()


def served(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def test_a_version_lands_in_the_served_tensors_and_experts_in_their_rows():
    engine, newer = Engine(tiny(1), max_batch=2, eos_id=-1), tiny(2)
    ptrs = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    engine.load_weights(state_dict_to_hf(newer), version=1)
    engine.step()
    got, want = engine.model.state_dict(), newer.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == ptrs, "copied in place"
    assert engine.version == 1


def test_a_tied_model_takes_a_version_with_or_without_its_lm_head():
    engine, newer = Engine(tiny(1, tie_word_embeddings=True), max_batch=2, eos_id=-1), tiny(2, tie_word_embeddings=True)
    hf = state_dict_to_hf(newer)
    assert "lm_head.weight" not in hf
    for state in (hf, {**hf, "lm_head.weight": newer.lm_head.weight.detach()}):
        engine.load_weights(state, version=1)
        engine.step()
        assert torch.equal(engine.model.lm_head.weight, newer.model.embed_tokens.weight)
        assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()


def test_a_refused_version_changes_nothing_and_the_engine_serves_on():
    engine, newer = Engine(tiny(1), max_batch=2, eos_id=-1), tiny(2)
    before = served(engine)
    no_expert = state_dict_to_hf(newer)
    del no_expert["model.layers.0.mlp.experts.3.up_proj.weight"]
    with pytest.raises(WeightsMismatch, match="missing"):
        engine.load_weights(no_expert, version=1)
    wrong = state_dict_to_hf(newer)
    wrong["model.layers.1.mlp.experts.0.down_proj.weight"] = torch.zeros(128, 64)
    with pytest.raises(WeightsMismatch, match="shape"):
        engine.load_weights(wrong, version=1)
    extra = {**state_dict_to_hf(newer), "model.layers.0.mlp.experts.99.gate_proj.weight": torch.zeros(128, 128)}
    with pytest.raises(WeightsMismatch, match="unexpected"):
        engine.load_weights(extra, version=1)
    engine.add_request(Request("a", [5, 6], SamplingParams(max_new_tokens=3, seed=0)))
    while engine.has_work():
        engine.step()
    assert engine.version == 0 and all(torch.equal(v, before[k]) for k, v in served(engine).items())


def test_an_fp8_served_model_quantises_each_module_as_its_tensors_arrive():
    engine = Engine(apply_fp8_mode(tiny(1), "all"), max_batch=2, eos_id=-1)
    newer = tiny(2)
    engine.load_weights(state_dict_to_hf(newer), version=1)
    engine.step()
    experts = engine.model.model.layers[0].mlp.experts
    q, s = quantize_weight(newer.model.layers[0].mlp.experts.gate_up_proj.detach())
    assert torch.equal(experts.gate_up_proj.view(torch.uint8), q.view(torch.uint8)) and torch.equal(experts.gate_up_proj_scale, s)
    proj = engine.model.model.layers[1].self_attn.o_proj
    q, s = quantize_weight(newer.model.layers[1].self_attn.o_proj.weight.detach())
    assert torch.equal(proj.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(proj.weight_scale, s)
    assert torch.equal(engine.model.model.embed_tokens.weight, newer.model.embed_tokens.weight)


def test_a_version_applied_from_the_store_mapping_reads_the_payload_in_place(tmp_path):
    key, newer = NodeKey.from_seed(b"\x05" * 32), tiny(2)
    store = Store(tmp_path / "s")
    publish(store, key, "r", 1, state_dict_to_hf(newer))
    got = read_held(store, TrustedPublishers([key.peer_id]), "r", 1)
    tensors = got.tensors()
    base = np.asarray(got.payload).ctypes.data
    assert all(base <= t.data_ptr() < base + len(got.payload) for t in tensors.values()), "views, not copies"
    engine = Engine(tiny(1), max_batch=2, eos_id=-1)
    rows: list = []
    engine.on_swap.append(lambda v, row: rows.append((v, row)))
    engine.load_weights(tensors, version=1)
    engine.step()
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in newer.state_dict().items())
    (v, row), = rows
    assert v == 1 and row["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert row["apply_s"] > 0 and row["staged_on_device"] is False and row["t_applied"] > 0


def test_a_staged_copy_of_a_served_form_version_is_sized_as_it_travels(tmp_path):
    """Room for a staged copy (`_staged_bytes`): a version in its served form is staged as e4m3 bytes and block scales,
    so it needs about half of what the same version in bf16 needs (at 30B: 29 GiB, where 56.9 GiB were asked for
    and an 80 GB card fell back to the slower unstaged swap, session 25)."""
    from node.engine.weight_staging import _staged_bytes
    from node.engine.weights import expected_shapes, plan_weights
    from node.model.served_form import ServedForm, served
    from node.rl.parallel.publish import publish_model

    model = apply_fp8_mode(tiny(1).to(torch.bfloat16), "all")
    newer = tiny(2, num_hidden_layers=2).to(torch.bfloat16)
    key, store = NodeKey.from_seed(b"\x07" * 32), Store(tmp_path / "s")
    publish_model(newer, None, store, key, "r", 1, None, None, fp8="all")
    version = served(read_held(store, TrustedPublishers([key.peer_id]), "r", 1).tensors(), torch.bfloat16)
    plain = state_dict_to_hf(newer)
    assert isinstance(version, ServedForm)
    shapes = expected_shapes(model)
    need_served = _staged_bytes(model, plan_weights(version, model.config, shapes), shapes, version)
    need_plain = _staged_bytes(model, plan_weights(plain, model.config, shapes), shapes, plain)
    e4m3 = {n: t for n, t in model.named_buffers() if t.dtype == torch.float8_e4m3fn}
    saved = sum(t.numel() for t in e4m3.values()) - sum(model.get_buffer(f"{n}_scale").numel() * 4 for n in e4m3)
    assert e4m3 and need_plain - need_served == saved  # one byte an element instead of two, plus the scales
