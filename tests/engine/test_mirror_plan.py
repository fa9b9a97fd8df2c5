"""A fetched payload read as one view a served tensor (`MirrorPlan`): stacked experts at one stride in the payload,
a served form's e4m3 bytes and scales too; a payload whose experts are out of order has no such view and goes
tensor by tensor; either way the served tensors end up the published ones."""

import pytest
import torch

from node.engine import Engine
from node.engine.fp8.model import apply_fp8_mode
from node.engine.weight_staging import MirrorPlan, MirrorPlans, StagedVersion, Strided
from node.engine.weights import WeightsMismatch, expected_shapes, plan_weights
from node.model import CausalLM, ModelConfig
from node.model.checkpoint import state_dict_to_hf
from node.model.served_form import served
from node.rl.parallel.publish import publish_model
from protocol.identity import NodeKey
from shardcast.fetch import PayloadTensors, read_held
from shardcast.manifest import TrustedPublishers
from shardcast.publish import publish
from shardcast.store import Store

KEY = NodeKey.from_seed(b"\x0b" * 32)


def tiny(seed=0, **kw) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(ModelConfig(vocab_size=64, hidden_size=128, moe_intermediate_size=128, head_dim=32, **kw)).eval()


def fetched(tmp_path, state: dict[str, torch.Tensor]) -> PayloadTensors:
    store = Store(tmp_path / "s")
    publish(store, KEY, "r", 1, state)
    return read_held(store, TrustedPublishers([KEY.peer_id]), "r", 1).tensors()


def applied(model: CausalLM, version, path: str) -> dict[str, torch.Tensor]:
    old, StagedVersion.PATH = StagedVersion.PATH, path
    try:
        engine = Engine(model, max_batch=2, eos_id=-1)
        staged = engine._check_weights(version)
        assert (staged.staged is not None) == (path == "mirror")
        engine._swap_weights(staged)
        return {k: v.clone() for k, v in engine.model.state_dict().items()}
    finally:
        StagedVersion.PATH = old


def test_a_payload_in_publish_order_is_one_view_a_served_tensor_and_lands_exactly(tmp_path):
    newer = tiny(2)
    version = fetched(tmp_path, state_dict_to_hf(newer))
    model = tiny(1)
    shapes = expected_shapes(model)
    mirror = MirrorPlan.of(plan_weights(version, model.config, shapes), version, shapes)
    assert mirror is not None and set(mirror.parts) == set(shapes)
    assert all(len(p) == 1 and p[0][0] is None and isinstance(p[0][1], Strided) for p in mirror.parts.values())
    views = mirror.views(version.base())
    assert all(t.untyped_storage().data_ptr() == version.base().data_ptr() for t in views.values()), "no copy"
    got = applied(model, version, "mirror")
    assert all(torch.equal(got[k], v) for k, v in newer.state_dict().items())


def test_a_served_form_payload_is_held_as_its_e4m3_bytes_and_scales(tmp_path):
    newer = tiny(2).to(torch.bfloat16)
    store = Store(tmp_path / "s")
    publish_model(newer, None, store, KEY, "r", 1, None, None, fp8="all")
    version = served(read_held(store, TrustedPublishers([KEY.peer_id]), "r", 1).tensors(), torch.bfloat16)
    make = lambda: apply_fp8_mode(tiny(1).to(torch.bfloat16), "all")  # noqa: E731
    shapes = expected_shapes(make())
    mirror = MirrorPlan.of(plan_weights(version, make().config, shapes), version, shapes)
    assert mirror is not None
    (_, (q, scales)), = mirror.parts["model.layers.0.mlp.experts.down_proj"]  # e4m3 bytes and scales, one view each
    assert q.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    gate, up = mirror.parts["model.layers.0.mlp.experts.gate_up_proj"]  # each expert's gate scales lie between them
    _, rows, _ = shapes["model.layers.0.mlp.experts.gate_up_proj"]
    assert (gate[0], up[0]) == ((0, rows // 2), (rows // 2, rows))
    by_mirror, by_tensor = applied(make(), version, "mirror"), applied(make(), version, "runs")
    assert set(by_mirror) == set(by_tensor)
    assert all(torch.equal(by_mirror[k].view(torch.uint8), by_tensor[k].view(torch.uint8)) for k in by_tensor)


def test_each_experts_gate_up_and_down_back_to_back_are_views_at_one_stride(tmp_path):
    newer = tiny(2)
    hf = state_dict_to_hf(newer)
    kinds = ("gate_proj", "up_proj", "down_proj")
    order = lambda n: (n.split(".experts.")[0], int(n.split(".experts.")[1].split(".")[0]), kinds.index(n.split(".")[-2])) \
        if ".experts." in n else (n, -1, 0)  # noqa: E731
    version = fetched(tmp_path, dict(sorted(hf.items(), key=lambda kv: order(kv[0]))))
    model = tiny(1)
    shapes = expected_shapes(model)
    mirror = MirrorPlan.of(plan_weights(version, model.config, shapes), version, shapes)
    _, rows, hidden = shapes["model.layers.0.mlp.experts.gate_up_proj"]
    _, h, inter = shapes["model.layers.0.mlp.experts.down_proj"]
    (_, gate_up), = mirror.parts["model.layers.0.mlp.experts.gate_up_proj"]
    (_, down), = mirror.parts["model.layers.0.mlp.experts.down_proj"]
    assert gate_up.stride == down.stride[:1] + (hidden, 1) == (rows * hidden + h * inter, hidden, 1)
    got = applied(model, version, "mirror")
    assert all(torch.equal(got[k], v) for k, v in newer.state_dict().items())


def test_experts_out_of_order_have_no_single_view_and_go_tensor_by_tensor(tmp_path):
    newer = tiny(2)
    hf = state_dict_to_hf(newer)
    shuffled = dict(sorted(hf.items(), key=lambda kv: (".experts.1." in kv[0], kv[0])))  # expert 1 after all others
    version = fetched(tmp_path, shuffled)
    model = tiny(1)
    shapes = expected_shapes(model)
    assert MirrorPlan.of(plan_weights(version, model.config, shapes), version, shapes) is None
    got = applied(model, version, "runs")
    assert all(torch.equal(got[k], v) for k, v in newer.state_dict().items())
    engine = Engine(tiny(1), max_batch=2, eos_id=-1)
    assert engine._check_weights(version).staged is None  # the mirror path declined it
    engine._swap_weights(engine._check_weights(version))
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in newer.state_dict().items())


def test_a_version_that_is_not_a_fetched_payload_has_no_mirror():
    model = tiny(1)
    shapes = expected_shapes(model)
    state = state_dict_to_hf(tiny(2))
    assert MirrorPlans().get(model, plan_weights(state, model.config, shapes), state, shapes) is None


def test_plans_are_made_once_per_layout(tmp_path, monkeypatch):
    version = fetched(tmp_path, state_dict_to_hf(tiny(2)))
    model = tiny(1)
    shapes = expected_shapes(model)
    plan = plan_weights(version, model.config, shapes)
    made = []
    real = MirrorPlan.of
    monkeypatch.setattr(MirrorPlan, "of", classmethod(lambda cls, *a: made.append(1) or real(*a)))
    plans = MirrorPlans()
    first = plans.get(model, plan, version, shapes)
    assert plans.get(model, plan, version, shapes) is first and len(made) == 1
    other = fetched(tmp_path / "b", dict(reversed(list(state_dict_to_hf(tiny(3)).items()))))
    plans.get(model, plan_weights(other, model.config, shapes), other, shapes)
    assert len(made) == 2


def test_a_payload_shorter_than_its_table_is_refused_before_anything_changes(tmp_path):
    version = fetched(tmp_path, state_dict_to_hf(tiny(2)))
    short = PayloadTensors(list(version.entries.values()), version.payload[: len(version.payload) // 2], None)
    engine = Engine(tiny(1), max_batch=2, eos_id=-1)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(WeightsMismatch, match="beyond the payload"):
        engine.load_weights(short, version=1)
    engine.step()
    assert engine.version == 0 and all(torch.equal(engine.model.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("served_fp8, published_fp8", [("all", None), (None, "all"), ("experts", "all")])
def test_mirror_and_tensor_by_tensor_serve_the_same_bytes_across_precisions(tmp_path, served_fp8, published_fp8):
    """A high-precision payload quantised on arrival, a served form dequantised into a bf16 model, and a served form
    whose FP8 experts take their e4m3 bytes while the attention (bf16 here) takes dequantised values."""
    newer = tiny(2).to(torch.bfloat16)
    store = Store(tmp_path / "s")
    publish_model(newer, None, store, KEY, "r", 1, None, None, fp8=published_fp8 or "off")
    version = read_held(store, TrustedPublishers([KEY.peer_id]), "r", 1).tensors()
    version = served(version, torch.bfloat16) if published_fp8 else version

    def make():
        model = tiny(1).to(torch.bfloat16)
        return apply_fp8_mode(model, served_fp8) if served_fp8 else model

    by_mirror, by_tensor = applied(make(), version, "mirror"), applied(make(), version, "runs")
    assert set(by_mirror) == set(by_tensor)
    assert all(torch.equal(by_mirror[k].view(torch.uint8), by_tensor[k].view(torch.uint8)) for k in by_tensor)


def test_every_tensor_a_staged_value_holds_is_found_for_the_engine_streams_record():
    """`apply` marks each staged tensor as read on the engine's stream; a served form's `Rows` hold pairs in a list (on
    the H100 the first version of this loop took a `Rows` for a tensor and failed)."""
    from node.engine.weight_staging import Rows, _tensors_of

    a, b, c, d = (torch.zeros(2) for _ in range(4))
    assert _tensors_of(a) == [a] and _tensors_of((a, b)) == [a, b]
    got = _tensors_of(Rows([(0, 1, (a, b)), (1, 2, (c, d))]))
    assert len(got) == 4 and all(x is y for x, y in zip(got, (a, b, c, d)))
