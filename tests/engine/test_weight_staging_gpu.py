"""The weight path onto a GPU: a version's tensors from the payload's mapping go through pinned buffers
and side-stream copies to a staged device copy while the engine decodes, then into the captured
graphs' own storage between two steps; without room for the staged copy, straight in at the swap;
FP8 modules quantised on the device. Skipped without CUDA (CI); run on the H200."""

import copy

import pytest
import torch

from node.engine import Request, SamplingParams
from node.engine import weight_staging
from node.engine.cuda_engine import CudaEngine
from node.model import CausalLM, ModelConfig
from node.model.checkpoint import state_dict_to_hf
from node.fp8.quantize import quantize_weight
from protocol.identity import NodeKey
from shardcast.fetch import read_held
from shardcast.manifest import TrustedPublishers
from shardcast.publish import publish
from shardcast.store import Store

pytestmark = pytest.mark.gpu


def model(seed=0) -> CausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=512, hidden_size=256, moe_intermediate_size=128, head_dim=128, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    return CausalLM(cfg).to(torch.bfloat16).eval()


def from_store(tmp_path, m: CausalLM) -> dict[str, torch.Tensor]:
    key = NodeKey.from_seed(b"\x06" * 32)
    store = Store(tmp_path / "s")
    publish(store, key, "r", 1, state_dict_to_hf(m))
    return read_held(store, TrustedPublishers([key.peer_id]), "r", 1).tensors()  # views over the mapping


def run(eng: CudaEngine, steps: int) -> None:
    eng.add_request(Request("a", [5, 6, 7], SamplingParams(max_new_tokens=steps + 8, seed=1)))
    for _ in range(steps):
        eng.step()


@pytest.mark.parametrize("room, path", [(True, "mirror"), (True, "runs"), (False, "mirror")])
def test_a_version_from_the_store_mapping_is_staged_then_swapped_under_captured_graphs(tmp_path, monkeypatch, room, path):
    """Staged as the payload's copy with views (`mirror`, the role's), tensor by tensor (`runs`), or not at all."""
    monkeypatch.setattr(weight_staging.StagedVersion, "PATH", path)
    if not room:  # a GPU without room for a staged copy: the swap copies straight from pinned buffers
        monkeypatch.setattr(weight_staging, "STAGING_HEADROOM", 1 << 50)
    old, newer = model(2), model(3)
    eng = CudaEngine(copy.deepcopy(old).cuda(), max_batch=4, eos_id=-1, version=1)
    eng.capture_all()
    ptrs = {n: p.data_ptr() for n, p in eng.model.named_parameters()}
    rows: list = []
    eng.on_swap.append(lambda v, row: rows.append(row))
    run(eng, 4)
    eng.load_weights(from_store(tmp_path, newer), version=2)
    while eng.has_work():
        eng.step()
    assert rows[0]["staged_on_device"] is room and rows[0]["apply_s"] > 0
    assert {n: p.data_ptr() for n, p in eng.model.named_parameters()} == ptrs, "same storage: graphs stay valid"
    got = eng.model.state_dict()
    assert all(torch.equal(got[k].cpu(), v) for k, v in newer.state_dict().items())


def test_an_fp8_engine_quantises_a_staged_version_on_the_device(tmp_path):
    eng = CudaEngine(model(2).cuda(), max_batch=4, eos_id=-1, fp8=True, version=1)
    newer = model(3)
    eng.load_weights(from_store(tmp_path, newer), version=2)
    eng.step()
    experts = eng.model.model.layers[1].mlp.experts
    q, s = quantize_weight(newer.model.layers[1].mlp.experts.down_proj.detach().cuda())
    assert torch.equal(experts.down_proj.view(torch.uint8), q.view(torch.uint8)) and torch.equal(experts.down_proj_scale, s)


@pytest.mark.parametrize("room", [True, False])
def test_a_served_form_version_moves_its_e4m3_bytes_and_dequantises_them_on_the_device(tmp_path, monkeypatch, room):
    """An FP8 run's version in its served form (node/model/served_form.py), its e4m3 bytes and scales moved to the
    GPU and dequantised there whole, staged or applied straight: the engine serves the e4m3 bytes an engine given
    the trainer's bf16 weights quantises itself (both quantised on a GPU)."""
    from node.model.served_form import ServedForm, served
    from node.rl.parallel.publish import publish_model

    if not room:
        monkeypatch.setattr(weight_staging, "STAGING_HEADROOM", 1 << 50)
    newer = model(3)
    key, store = NodeKey.from_seed(b"\x09" * 32), Store(tmp_path / "s")
    publish_model(newer.cuda(), None, store, key, "r", 1, None, None, fp8="all")  # quantised where the trainer is
    newer.cpu()
    version = served(read_held(store, TrustedPublishers([key.peer_id]), "r", 1).tensors(), torch.bfloat16)
    assert isinstance(version, ServedForm)
    held = {}
    for form, state in (("served", version), ("plain", state_dict_to_hf(newer))):
        eng = CudaEngine(model(2).cuda(), max_batch=4, eos_id=-1, fp8="all", version=1)
        eng.load_weights(state, version=2)
        eng.step()
        held[form] = {n: t.clone() for n, t in eng.model.named_buffers()}
    e4m3 = [n for n, t in held["plain"].items() if t.dtype == torch.float8_e4m3fn]
    assert e4m3 and all(torch.equal(held["served"][n].view(torch.uint8), held["plain"][n].view(torch.uint8)) for n in e4m3)
    assert all(torch.allclose(held["served"][f"{n}_scale"], held["plain"][f"{n}_scale"], rtol=2**-7, atol=0) for n in e4m3)
