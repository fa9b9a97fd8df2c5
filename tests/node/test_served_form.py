"""An FP8 run publishes its versions after 0 in their served form (e4m3 + block scales for what it serves in
FP8), members fetch them over shardcast and read the values, and an FP8 engine serves the trainer's bytes."""

import asyncio
import copy

import pytest
import torch

from node.engine import Engine, Request, SamplingParams
from node.engine.fp8.model import apply_fp8_mode
from node.fp8.quantize import quantize_weight
from node.model.checkpoint import state_dict_to_hf
from node.model.checkpoint import InternalTensors, InvalidCheckpoint
from node.model.errors import MismatchedScales
from node.model.quantization import SCALE_SUFFIX, dequantize
from node.model import CausalLM, ModelConfig
from node.model.served_form import ServedForm, fp8_served_params, served
from node.roles.common import fetch_policy, fresh_model
from node.roles.resident_policy import ResidentPolicies, raw_tensors
from node.rl.parallel.publish import publish_model
from protocol.identity import NodeKey
from protocol.messages import RunSpec
from protocol.model_spec import ModelSpec
from shardcast.fetch import read_held
from shardcast.manifest import TrustedPublishers
from shardcast.server import ShardServer
from shardcast.store import Store

PEER = "12D3KooWGzh1b2VJ2c8Nk5rQb9P9s1p7pY9yq1Qe4sXvTtF3gW8E"


def _spec(**kw) -> RunSpec:
    return RunSpec(run_id="r", coordinator=PEER, environment="reverse", model=ModelSpec(fp8="all"), **kw)


def _stepped(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """`model` after an RL step's worth of change to every weight."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3 * p.std().clamp_min(1e-3))
    return model


def _fetch(store: Store, key: NodeKey, version: int):
    async def main():
        server = ShardServer(store)
        port = await server.start("127.0.0.1", 0)
        spec = _spec(trainer=key.peer_id, shardcast_sources=[f"http://127.0.0.1:{port}"])
        try:
            return await fetch_policy(spec, Store(store.root.parent / f"member-{version}"), version)
        finally:
            await server.stop()
    return asyncio.run(main())


def test_an_fp8_run_publishes_every_version_in_its_served_form_and_members_read_its_values(tmp_path):
    key, store = NodeKey.from_seed(b"\x07" * 32), Store(tmp_path / "trainer")
    model = fresh_model(_spec())
    plain = publish_model(model, None, Store(tmp_path / "plain"), key, "r", 0, None, None).manifest
    v0 = publish_model(model, None, store, key, "r", 0, None, None, fp8="all").manifest
    assert v0.total_bytes < plain.total_bytes
    _stepped(model, 1)
    v1 = publish_model(model, None, store, key, "r", 1, 0, None, fp8="all").manifest
    quantised = {e.name[: -len(SCALE_SUFFIX)] for e in v1.tensors if e.name.endswith(SCALE_SUFFIX)}
    want = state_dict_to_hf(model)
    # the tiny model's experts are 64 rows wide: gate and up are not on block edges (stay plain); the rest goes e4m3
    assert quantised == {n for n in want if n.endswith("down_proj.weight") or (".self_attn." in n and n.endswith("_proj.weight"))}
    assert [e.name for e in v0.tensors] == [e.name for e in v1.tensors], "version 0 is in the same served form"
    assert v1.encoding == "delta" and v1.parent == 0, "so version 1 is a delta of it"
    assert len(fp8_served_params(model, "all")) > len(fp8_served_params(model, "experts")) > 0

    got = _fetch(store, key, 1)
    assert isinstance(got, ServedForm) and set(got) == set(want)
    for name, w in want.items():
        if name in quantised:
            assert torch.equal(got[name], dequantize(*quantize_weight(w), w.dtype)), name
        else:
            assert torch.equal(got[name], w), name

    # the next version is a delta of this one (same layout), and reads the same way
    _stepped(model, 2)
    v2 = publish_model(model, None, store, key, "r", 2, 1, None, fp8="all").manifest
    assert v2.encoding == "delta" and v2.parent == 1
    got2 = _fetch(store, key, 2)
    w = state_dict_to_hf(model)["model.layers.1.mlp.experts.2.down_proj.weight"]
    assert torch.equal(got2["model.layers.1.mlp.experts.2.down_proj.weight"], dequantize(*quantize_weight(w), w.dtype))


def test_an_fp8_engine_serves_the_trainers_e4m3_bytes_from_a_served_form_version(tmp_path):
    """Experts 128 rows wide: everything the run serves in FP8 travels as e4m3; the engine that loads the
    served form holds the published bytes as they are, the same as one that quantises the trainer's
    high-precision weights itself, generates the same tokens, and the validator's resident model holds them too."""
    torch.manual_seed(4)
    model = CausalLM(ModelConfig(vocab_size=64, hidden_size=128, moe_intermediate_size=128, head_dim=32)).eval()
    key, store = NodeKey.from_seed(b"\x08" * 32), Store(tmp_path / "trainer")
    manifest = publish_model(model, None, store, key, "r", 1, None, None, fp8="all").manifest
    assert any(e.name.endswith(f"gate_proj.weight{SCALE_SUFFIX}") for e in manifest.tensors)
    version = served(read_held(store, TrustedPublishers([key.peer_id]), "r", 1).tensors(), torch.float32)
    assert isinstance(version, ServedForm)

    engines = {}
    for form, state in (("served", version), ("plain", state_dict_to_hf(model))):
        blank = copy.deepcopy(model)
        engine = Engine(apply_fp8_mode(blank, "all"), max_batch=2, eos_id=-1)
        with torch.no_grad():  # nothing of the trainer's weights left in the engine before the version lands
            for t in engine.model.buffers():
                t.zero_()
        engine.load_weights(state, version=1)
        engines[form] = engine
    tokens = [[c.token_ids for c in e.generate([Request("a", [5, 6, 7], SamplingParams(max_new_tokens=6, seed=0))])]
              for e in engines.values()]
    served_, plain = (dict(engines[f].model.named_buffers()) for f in ("served", "plain"))
    e4m3 = [n for n, t in plain.items() if t.dtype == torch.float8_e4m3fn]
    assert len(e4m3) == 2 * 4 + 2 * 2, "q, k, v, o and both expert tensors of each layer"
    # the served form's engine holds the trainer's bytes as they are: e4m3 and scales
    published = InternalTensors(version, model.config)
    for n in e4m3:
        q, s = published.fp8(n)
        assert torch.equal(served_[n].view(torch.uint8), q.view(torch.uint8)) and torch.equal(served_[f"{n}_scale"], s), n
    # and the same e4m3 bytes as an engine that quantised the bf16 weights itself (the same rule)
    assert all(torch.equal(served_[n].view(torch.uint8), plain[n].view(torch.uint8)) for n in e4m3)
    assert all(torch.equal(served_[f"{n}_scale"], plain[f"{n}_scale"]) for n in e4m3)
    assert tokens[0] == tokens[1]

    # the validator's resident model reads the version's bytes as they are too: judging sees the node's weights
    held = ResidentPolicies(apply_fp8_mode(copy.deepcopy(model), "all"), 0, b"\0" * 32)
    held.add(1, version, b"\1" * 32)
    held.activate(1)
    assert all(torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                           served_[n].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else served_[n])
               for n, t in held[1][0].named_buffers() if n in served_)


def test_a_served_form_version_with_wrong_scales_is_refused_with_a_typed_error():
    w = torch.randn(256, 128)
    q, s = quantize_weight(w)
    name = "model.layers.0.self_attn.o_proj.weight"
    ok = ServedForm({name: q, f"{name}{SCALE_SUFFIX}": s, "model.norm.weight": torch.ones(8)}, torch.float32)
    assert set(ok) == {name, "model.norm.weight"} and torch.equal(ok[name], dequantize(q, s, torch.float32))
    with pytest.raises(MismatchedScales, match="missing"):
        ServedForm({name: q}, torch.float32)
    with pytest.raises(MismatchedScales, match="expected float32"):
        ServedForm({name: q, f"{name}{SCALE_SUFFIX}": s[:1]}, torch.float32)
    with pytest.raises(MismatchedScales, match="not float8"):
        ServedForm({name: w, f"{name}{SCALE_SUFFIX}": s}, torch.float32)
    with pytest.raises(MismatchedScales, match="no weight"):
        ServedForm({f"{name}{SCALE_SUFFIX}": s}, torch.float32)


def test_a_served_form_version_mixing_e4m3_and_plain_pieces_of_one_served_tensor_is_refused_whole(tmp_path):
    """An expert's gate in e4m3 and its up plain (one stacked served tensor): `WeightsMismatch` before anything
    is copied, and the engine serves on with the version it had; the honest version loads."""
    from node.engine.weights import WeightsMismatch

    torch.manual_seed(5)
    model = CausalLM(ModelConfig(vocab_size=64, hidden_size=128, moe_intermediate_size=128, head_dim=32)).eval()
    key, store = NodeKey.from_seed(b"\x0a" * 32), Store(tmp_path / "trainer")
    publish_model(model, None, store, key, "r", 1, None, None, fp8="all")
    tensors = dict(read_held(store, TrustedPublishers([key.peer_id]), "r", 1).tensors())
    up = "model.layers.0.mlp.experts.1.up_proj.weight"
    mixed = dict(tensors)
    mixed[up] = dequantize(tensors[up], mixed.pop(f"{up}{SCALE_SUFFIX}"), torch.float32)
    engine = Engine(apply_fp8_mode(copy.deepcopy(model), "all"), max_batch=2, eos_id=-1)
    before = {n: t.clone() for n, t in engine.model.named_buffers()}
    with pytest.raises(WeightsMismatch, match="partly in e4m3"):
        engine.load_weights(ServedForm(mixed, torch.float32), version=1)
    engine.step()
    assert engine.version == 0 and all(torch.equal(t, before[n]) for n, t in engine.model.named_buffers())
    engine.load_weights(ServedForm(tensors, torch.float32), version=1)
    engine.step()
    assert engine.version == 1
    # the validator's resident model refuses the mixed version as well, and takes the honest one
    held = ResidentPolicies(apply_fp8_mode(_stepped(copy.deepcopy(model), 9), "all"), 0, b"\0" * 32)
    v0 = {n: t.clone() for n, t in raw_tensors(held[0][0]).items()}
    with pytest.raises(InvalidCheckpoint, match="partly in e4m3"):
        held.add(1, ServedForm(mixed, torch.float32), b"\1" * 32)
    assert 1 not in held and all(torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                                             v0[n].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else v0[n])
                                 for n, t in raw_tensors(held[0][0]).items()), "nothing read in"
    held.add(2, ServedForm(tensors, torch.float32), b"\2" * 32)
    assert 2 in held


@pytest.mark.parametrize("form", ["served", "plain"])
def test_a_validator_whose_first_version_is_any_form_holds_the_bytes_an_inference_node_serves(tmp_path, form):
    """The validator's first version builds its resident model (`resident_model`: FP8 modules first, the
    version loaded into them, as an inference node builds its own), and it holds the node's e4m3 bytes and
    scales bit for bit, whether the version came in its served form or in bf16."""
    from node.roles.common import blank_model
    from node.roles.validator import resident_model

    spec = RunSpec(run_id="r", coordinator=PEER, environment="reverse", model=ModelSpec(fp8="all", dtype="bfloat16"))
    model = _stepped(fresh_model(spec), 6)
    assert next(model.parameters()).dtype == torch.bfloat16
    key, store = NodeKey.from_seed(b"\x0b" * 32), Store(tmp_path / "trainer")
    publish_model(model, None, store, key, "r", 1, None, None, fp8="all" if form == "served" else "off")
    version = served(read_held(store, TrustedPublishers([key.peer_id]), "r", 1).tensors(), torch.bfloat16)
    assert isinstance(version, ServedForm) == (form == "served")
    engine = Engine(blank_model(spec, "cpu", "all"), max_batch=2, eos_id=-1)
    engine.load_weights(version, version=1)
    engine.step()
    node = dict(engine.model.named_buffers())
    judge = dict(resident_model(spec, "cpu", version).named_buffers())
    e4m3 = [n for n, t in node.items() if t.dtype == torch.float8_e4m3fn]
    assert e4m3 and all(torch.equal(judge[n].view(torch.uint8), node[n].view(torch.uint8)) and
                        torch.equal(judge[f"{n}_scale"], node[f"{n}_scale"]) for n in e4m3)
