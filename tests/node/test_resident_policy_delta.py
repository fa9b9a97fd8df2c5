"""A version fetched as a delta of the validator's newest held version is prepared from the delta's changed bytes
alone (`ResidentPolicies.prepare` -> `_step_from_changes`), never read whole: the step, the model after `commit`, and
every older version switched back to, are bit for bit what reading the version whole gives. A version that is not
a delta of the newest held one (or whose bytes an FP8 module quantises on arrival) is read whole, as before."""

from __future__ import annotations

import copy

import pytest
import torch

from node.engine.fp8.model import apply_fp8_mode
from node.model import CausalLM, ModelConfig
from node.model.checkpoint import load_hf_state_dict
from node.roles.resident_policy import ResidentPolicies, raw_tensors
from node.rl.parallel.publish import publish_model
from protocol.identity import NodeKey
from shardcast.publish import PublishOptions
from shardcast.store import Store

from fetched_versions import fetch_all, whole

KEY = NodeKey.from_seed(b"\x0c" * 32)
SHARDS = PublishOptions(shard_size=64 << 10)


def _stepped(model: CausalLM, seed: int) -> CausalLM:
    """`model` after a sparse step: a few rows of one expert, some elements of the embedding, the final norm."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        rows = model.model.layers[0].mlp.experts.down_proj[1][:8]
        rows.add_(torch.randn(rows.shape, generator=g) * 0.01)
        emb = model.model.embed_tokens.weight.view(-1)
        at = torch.randint(0, emb.numel(), (50,), generator=g)
        emb[at] += 0.03
        model.model.norm.weight.add_(0.01)
    return model


def _fetched(tmp_path, fp8: str, published: str, versions: int, one_host: bool = False) -> dict:
    """`versions` versions published by a trainer and fetched by a validator: into its own store over the wire, or
    (`one_host`) from the trainer's store it shares (`sim`'s roles on one host), each asked against the one before."""
    torch.manual_seed(7)
    model = CausalLM(ModelConfig(vocab_size=64, hidden_size=256, moe_intermediate_size=256, head_dim=32)).eval()
    trainer = Store(tmp_path / "trainer")
    publish_model(model, None, trainer, KEY, "r", 0, None, SHARDS, fp8=published)
    got = fetch_all(trainer, trainer, KEY, fp8, [0]) if one_host else {}
    for v in range(1, versions):
        assert publish_model(_stepped(model, v), None, trainer, KEY, "r", v, v - 1, SHARDS,
                             fp8=published).manifest.encoding == "delta"
        if one_host:  # fetched as it is listed (the store's retention keeps the newest few payloads)
            got |= fetch_all(trainer, trainer, KEY, fp8, [v], changes_of=lambda v: v - 1)
    if one_host:
        return model.config, got
    return model.config, fetch_all(trainer, Store(tmp_path / "validator"), KEY, fp8, list(range(versions)))


def _resident(cfg: ModelConfig, state, fp8: str, device: str = "cpu") -> ResidentPolicies:
    """A validator's resident model holding version 0, read in by the validator's own path (FP8 modules too)."""
    model = apply_fp8_mode(CausalLM(cfg), fp8).eval().to(device)
    first = ResidentPolicies(model, -1, b"\1" * 32)  # the model's random weights as a version before 0
    first.commit(first.prepare(0, whole(state), b"\0" * 32))
    return ResidentPolicies(model, 0, b"\0" * 32)


def _bits(model: torch.nn.Module) -> dict[str, bytes]:
    return {n: t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes() for n, t in raw_tensors(model).items()}


@pytest.mark.parametrize("fp8,published", [("off", "off"), ("all", "all")])  # bf16-less CPU: float32 / served form
@pytest.mark.parametrize("one_host", [False, True])
def test_a_delta_of_the_newest_version_is_prepared_from_its_changed_bytes_and_equals_a_whole_read(tmp_path, fp8,
                                                                                                   published, one_host):
    # one_host: the version was listed in the store the validator shares with the trainer, never decoded as a delta;
    # its changed bytes come from the two payloads the store holds
    cfg, got = _fetched(tmp_path, fp8, published, 4, one_host)
    assert got[1].changes is not None and got[1].changes.parent == 0
    _prepared_from_changes_as_whole_reads(cfg, got, fp8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the validator's model on a GPU")
@pytest.mark.parametrize("fp8,published", [("off", "off"), ("all", "all")])
def test_on_a_gpu_a_version_listed_beside_the_validator_is_prepared_from_its_changed_bytes(tmp_path, fp8, published):
    # the one-host network's path on its device: the step built on the GPU from the compared payloads, the whole
    # read through the pinned ring, both to the same bits
    cfg, got = _fetched(tmp_path, fp8, published, 4, one_host=True)
    _prepared_from_changes_as_whole_reads(cfg, got, fp8, "cuda")


def test_on_the_trainers_host_a_version_has_no_changed_bytes_unless_asked_against_a_held_one(tmp_path):
    _, got = _fetched(tmp_path, "off", "off", 3, one_host=True)
    assert got[0].changes is None and all(got[v].changes.parent == v - 1 for v in (1, 2))
    host = Store(tmp_path / "trainer")
    plain = fetch_all(host, host, KEY, "off", [2])[2]
    assert plain.changes is None  # held, not decoded, not asked: read whole
    again = fetch_all(host, host, KEY, "off", [2], lambda v: 1)[2]
    assert again.changes.parent == 1 and (again.changes.positions == got[2].changes.positions).all()
    assert fetch_all(host, host, KEY, "off", [2], lambda v: 7)[2].changes is None  # a version the store lacks


def _prepared_from_changes_as_whole_reads(cfg: ModelConfig, got: dict, fp8: str, device: str = "cpu") -> None:
    sparse, full = _resident(cfg, got[0], fp8, device), _resident(cfg, got[0], fp8, device)
    assert _bits(sparse.model) == _bits(full.model)
    snapshots = {0: _bits(full.model)}
    for v in (1, 2, 3):
        fast = sparse.prepare(v, got[v], bytes([v]) * 32)
        slow = full.prepare(v, whole(got[v]), bytes([v]) * 32)
        assert fast.changed_bytes == len(got[v].changes.positions) and slow.changed_bytes is None
        assert set(fast.step) == set(slow.step) and fast.step, "the same tensors changed"
        for name, d in slow.step.items():
            mine = fast.step[name]
            for a, b in ((mine.index, d.index), (mine.values, d.values), (mine.resident, d.resident)):
                assert (a is None) == (b is None) and (a is None or torch.equal(a.cpu(), b.cpu())), name
        sparse.commit(fast)
        full.commit(slow)
        snapshots[v] = _bits(full.model)
        assert _bits(sparse.model) == snapshots[v]
    for v in (0, 2, 1, 3):  # any version switched to is the one the whole reads held
        assert _bits(sparse[v][0]) == snapshots[v], v


def test_a_version_that_is_not_a_delta_of_the_newest_held_one_is_read_whole(tmp_path):
    cfg, got = _fetched(tmp_path, "off", "off", 3)
    held = _resident(cfg, got[0], "off")
    skipped = held.prepare(2, got[2], b"\2" * 32)  # a delta of 1, which this validator never held
    assert got[2].changes.parent == 1 and skipped.changed_bytes is None
    held.commit(skipped)
    ref = CausalLM(cfg).eval()
    load_hf_state_dict(ref, whole(got[2]))
    assert _bits(held.model) == _bits(ref)


def test_a_plain_version_into_fp8_modules_is_read_whole_its_bytes_being_quantised_on_arrival(tmp_path):
    cfg, got = _fetched(tmp_path, "all", "off", 2)  # published plain, held in FP8: the bytes are not the payload's
    assert got[1].changes is not None
    held = _resident(cfg, got[0], "all")
    prepared = held.prepare(1, got[1], b"\1" * 32)
    assert prepared.changed_bytes is None
    held.commit(prepared)
    ref = _resident(cfg, got[1], "all")
    assert _bits(held.model) == _bits(ref.model)


def test_a_delta_decoded_against_the_held_version_is_not_compared_again(tmp_path, monkeypatch):
    """Over the wire, a delta of the validator's newest version was compared with it as it was decoded: asking for its
    changed bytes against that version compares no payloads again, even where the decoding found too many."""
    import shardcast.fetch

    def compared(*args, **kw):
        raise AssertionError("payloads compared for a delta decoded against the same version")

    torch.manual_seed(7)
    model = CausalLM(ModelConfig(vocab_size=64, hidden_size=256, moe_intermediate_size=256, head_dim=32)).eval()
    trainer = Store(tmp_path / "trainer")
    publish_model(model, None, trainer, KEY, "r", 0, None, SHARDS)
    with torch.no_grad():  # every weight moves: past the limit, the decoding keeps no changed bytes
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    assert publish_model(model, None, trainer, KEY, "r", 1, 0, SHARDS).manifest.encoding == "delta"
    member = Store(tmp_path / "validator")
    fetch_all(trainer, member, KEY, "off", [0])
    monkeypatch.setattr(shardcast.fetch, "payload_changes", compared)
    got = fetch_all(trainer, member, KEY, "off", [1], lambda v: 0)[1]
    assert got.changes is None
