"""A version fetched as a delta of the one an engine serves goes in as its changed bytes alone (`SparseWrites`):
the engine then holds exactly what a copy of the whole version gives it, and where it serves another version
than the delta's parent (or cannot place the bytes as they are) the version is copied whole instead."""

import copy

import pytest
import torch

from node.engine import Engine, Request, SamplingParams
from node.engine.fp8.model import apply_fp8_mode
from node.model import CausalLM, ModelConfig
from node.rl.parallel.publish import publish_model
from protocol.identity import NodeKey
from shardcast.publish import PublishOptions
from shardcast.store import Store

from fetched_versions import fetch_all, whole

KEY = NodeKey.from_seed(b"\x0b" * 32)
SHARDS = PublishOptions(shard_size=64 << 10)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _moved(model: CausalLM, seed: int) -> CausalLM:
    """`model` after a step that moves 8 rows of one expert of layer 0 and the final norm (the rest is unchanged)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        rows = model.model.layers[0].mlp.experts.down_proj[1][:8]
        rows.add_(torch.randn_like(rows) * 0.01)
        model.model.norm.weight.add_(0.01)
    return model


def _engine(model: CausalLM, fp8: str, device: str, rows: list) -> Engine:
    blank = copy.deepcopy(model)
    engine = Engine(apply_fp8_mode(blank, fp8).to(device), max_batch=2, eos_id=-1)
    with torch.no_grad():  # nothing of the trainer's weights in the engine before a version lands
        for t in [*engine.model.buffers(), *engine.model.parameters()]:
            t.zero_()
    engine.on_swap.append(lambda v, row: rows.append((v, row)))
    return engine


def _load(engine: Engine, state, version: int) -> list[int]:
    engine.load_weights(state, version=version)
    return engine.generate([Request(f"r{version}", [5, 6, 7], SamplingParams(max_new_tokens=5, seed=0))])[0].token_ids


def _served_bytes(engine: Engine) -> dict[str, torch.Tensor]:
    named = {**dict(engine.model.named_buffers()), **dict(engine.model.named_parameters())}
    return {n: t.detach().reshape(-1).view(torch.uint8).cpu() for n, t in named.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", ["off", "all"])
def test_a_delta_of_the_served_version_goes_in_as_its_changed_bytes_and_equals_a_whole_copy(tmp_path, fp8, device):
    torch.manual_seed(3)
    model = CausalLM(ModelConfig(vocab_size=64, hidden_size=256, moe_intermediate_size=256, head_dim=32)).eval()
    trainer = Store(tmp_path / "trainer")
    publish_model(model, None, trainer, KEY, "r", 0, None, SHARDS, fp8=fp8)
    for v in (1, 2, 3):
        signed = publish_model(_moved(model, v), None, trainer, KEY, "r", v, v - 1, SHARDS, fp8=fp8)
        assert signed.manifest.encoding == "delta"
    got = fetch_all(trainer, Store(tmp_path / "member"), KEY, fp8, [0, 1, 2, 3])
    assert got[0].changes is None, "version 0 is whole"
    assert getattr(got[1], "changes", None) is not None and got[1].changes.parent == 0
    changed = len(got[1].changes.positions)
    total = sum(e.nbytes for e in got[1].changes.tensors)
    assert 0 < changed < total / 100, (changed, total)  # 8 rows of one expert and a norm

    rows: list = []
    engine = _engine(model, fp8, device, rows)
    _load(engine, got[0], 0)
    tokens1 = _load(engine, got[1], 1)  # serving 0: version 1's changed bytes alone
    assert rows[-1][0] == 1 and rows[-1][1]["sparse_bytes"] == changed
    ref_rows: list = []
    ref = _engine(model, fp8, device, ref_rows)
    assert _load(ref, whole(got[1]), 1) == tokens1 and ref_rows[-1][1]["sparse_bytes"] == 0
    mine, want = _served_bytes(engine), _served_bytes(ref)
    assert set(mine) == set(want) and all(torch.equal(mine[n], want[n]) for n in want), "bytes of a whole copy"

    # serving 1, given 3 (a delta of 2, which it never held): copied whole, and right
    _load(engine, got[3], 3)
    assert rows[-1][0] == 3 and rows[-1][1]["sparse_bytes"] == 0
    _load(ref, whole(got[3]), 3)
    mine, want = _served_bytes(engine), _served_bytes(ref)
    assert all(torch.equal(mine[n], want[n]) for n in want)


def test_a_plain_version_into_an_fp8_engine_is_copied_whole_its_bytes_being_quantised_on_arrival(tmp_path):
    """A bf16 (plain) version served in FP8: the engine quantises each tensor as it lands, so the published
    bytes are not the served ones and a delta's changed bytes cannot be written as they are."""
    torch.manual_seed(5)
    model = CausalLM(ModelConfig(vocab_size=64, hidden_size=256, moe_intermediate_size=256, head_dim=32)).eval()
    trainer = Store(tmp_path / "trainer")
    publish_model(model, None, trainer, KEY, "r", 0, None, SHARDS)  # plain, as PRIMERL_PUBLISH_FORM=plain does
    publish_model(_moved(model, 1), None, trainer, KEY, "r", 1, 0, SHARDS)
    got = fetch_all(trainer, Store(tmp_path / "member"), KEY, "all", [0, 1])
    assert got[1].changes is not None
    rows: list = []
    engine = _engine(model, "all", "cpu", rows)
    _load(engine, got[0], 0)
    _load(engine, got[1], 1)
    assert rows[-1][1]["sparse_bytes"] == 0
    ref_rows: list = []
    ref = _engine(model, "all", "cpu", ref_rows)
    _load(ref, dict(got[1]), 1)
    mine, want = _served_bytes(engine), _served_bytes(ref)
    assert all(torch.equal(mine[n], want[n]) for n in want)


def test_a_delta_that_changes_most_bytes_keeps_no_changes_and_goes_whole(tmp_path):
    """Past `CHANGES_UP_TO` of the version the fetch keeps no changed bytes (they would cost what a whole copy
    does): the engine copies the version whole, and holds it exactly."""
    from shardcast.changes import CHANGES_UP_TO

    torch.manual_seed(6)
    model = CausalLM(ModelConfig(vocab_size=64, hidden_size=128, moe_intermediate_size=128, head_dim=32)).eval()
    trainer = Store(tmp_path / "trainer")
    publish_model(model, None, trainer, KEY, "r", 0, None, SHARDS)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # every weight moves: a dense step
    signed = publish_model(model, None, trainer, KEY, "r", 1, 0, SHARDS)
    assert signed.manifest.encoding == "delta"
    got = fetch_all(trainer, Store(tmp_path / "member"), KEY, "off", [0, 1])
    assert got[1].changes is None and CHANGES_UP_TO < 1
    rows: list = []
    engine = _engine(model, "off", "cpu", rows)
    _load(engine, got[0], 0)
    _load(engine, got[1], 1)
    assert rows[-1][1]["sparse_bytes"] == 0
    ref = _engine(model, "off", "cpu", [])
    _load(ref, dict(got[1]), 1)
    mine, want = _served_bytes(engine), _served_bytes(ref)
    assert all(torch.equal(mine[n], want[n]) for n in want)
