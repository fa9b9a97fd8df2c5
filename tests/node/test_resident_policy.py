"""One resident model for every version a validator judges (node/roles/resident_policy.py): each version,
applied in place, holds bit for bit the weights a model of that version alone holds."""

import pytest
import torch

from node.engine.fp8.model import apply_fp8_mode
from node.model.checkpoint import InvalidCheckpoint, load_hf_state_dict, state_dict_to_hf
from node.model.qwen3_moe import CausalLM
from node.model.tiny import TinyMoE
from node.model.tokenizer import CharTokenizer
from node.roles.resident_policy import ResidentPolicies, raw_tensors

CFG = TinyMoE(hidden=64, layers=2, experts=4, top_k=2, seed=0).config(CharTokenizer().vocab_size)


def versions() -> list[dict[str, torch.Tensor]]:
    """v0; v1 a sparse step (a few elements of a few tensors); v2 a dense step (every element); v3 sparse again."""
    torch.manual_seed(0)
    v0 = {k: t.clone() for k, t in state_dict_to_hf(CausalLM(CFG)).items()}
    g = torch.Generator().manual_seed(1)
    v1 = {k: t.clone() for k, t in v0.items()}
    for k in list(v1)[::3]:
        flat = v1[k].view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=g)
        flat[idx] += 0.5
    v2 = {k: t + 1e-3 * torch.randn(t.shape, generator=g) for k, t in v1.items()}
    v3 = {k: t.clone() for k, t in v2.items()}
    v3["model.embed_tokens.weight"][3, :5] = 7.0
    return [v0, v1, v2, v3]


def alone(state: dict[str, torch.Tensor], fp8: str) -> CausalLM:
    model = CausalLM(CFG)
    load_hf_state_dict(model, state)
    return apply_fp8_mode(model, fp8).eval()


def bits(model: torch.nn.Module) -> dict[str, bytes]:
    return {n: t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes() for n, t in raw_tensors(model).items()}


@pytest.mark.parametrize("fp8", ["off", "experts"])
def test_every_version_applied_in_place_is_bit_for_bit_the_model_of_that_version_alone(fp8):
    vs = versions()
    held = ResidentPolicies(alone(vs[0], fp8), 0, b"\0" * 32)
    for v in (1, 3, 2):  # newer ones rebase the held deltas; 2 arrives after 3 (an older version fetched late)
        held.add(v, vs[v], bytes([v]) * 32)
    assert held.newest == 3 and sorted(held) == [0, 1, 2, 3]
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    for v in (2, 0, 3, 1, 1, 0, 2):  # any order of switches
        model, h = held[v]
        want = alone(vs[v], fp8)
        assert bits(model) == bits(want), v
        assert h == (bytes([v]) * 32 if v else b"\0" * 32)
        with torch.inference_mode():
            assert torch.equal(model(ids).logits, want(ids).logits)
    # a sparse step is held sparse: far fewer bytes than a copy of the model (in FP8 a changed element
    # rescales its whole 128 x 128 block, which at this size is the whole tensor: no sparsity to show)
    model_bytes = sum(t.numel() * t.element_size() for t in raw_tensors(held.model).values())
    sparse = ResidentPolicies(alone(vs[0], fp8), 0, b"\0" * 32)
    sparse.add(1, vs[1], b"\1" * 32)
    assert 0 < sparse.delta_bytes < (model_bytes / 4 if fp8 == "off" else 2 * model_bytes)
    held.drop(0)
    assert 0 not in held and bits(held[1][0]) == bits(alone(vs[1], fp8))
    with pytest.raises(ValueError):
        held.drop(3)  # the resident version


def test_a_newer_version_adds_one_step_and_leaves_the_held_steps_untouched():
    """The chain: adding a newer version stores the old newest's step and changes no step already held
    (each was rebased onto every new version before: 9-20 s a version on the host, session 14)."""
    vs = versions()
    held = ResidentPolicies(alone(vs[0], "off"), 0, b"\0" * 32)
    held.add(1, vs[1], b"\1" * 32)
    step0 = held.deltas[0]
    kept = {n: (d.index, d.values, d.resident) for n, d in step0.items()}
    held.add(2, vs[2], b"\2" * 32)
    held.add(3, vs[3], b"\3" * 32)
    assert held.deltas[0] is step0 and {n: (d.index, d.values, d.resident) for n, d in step0.items()} == kept
    assert set(held.deltas[2]) == {"model.embed_tokens.weight"}  # v2 -> v3 changed one tensor, sparsely
    assert held.deltas[2]["model.embed_tokens.weight"].index.numel() == 5
    for v in (0, 3, 1):
        assert bits(held[v][0]) == bits(alone(vs[v], "off")), v


@pytest.mark.parametrize("fp8", ["off", "experts"])
def test_preparing_a_version_only_reads_the_model_and_its_commit_is_the_version_alone(fp8):
    """`prepare` (the validator runs it beside rounds that judge the newest version) leaves the model's bits and
    logits as they were; `commit` then holds the new version bit for bit, every older one still reachable; a
    preparation made against a newest version that moved on is refused, and one needs the model at the newest."""
    vs = versions()
    held = ResidentPolicies(alone(vs[0], fp8), 0, b"\0" * 32)
    held.add(1, vs[1], b"\1" * 32)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    before = bits(held.model)
    with torch.inference_mode():
        logits = held.model(ids).logits
    ready = held.prepare(2, vs[2], b"\2" * 32)
    assert bits(held.model) == before and held.newest == 1 and 2 not in held
    with torch.inference_mode():
        assert torch.equal(held[1][0](ids).logits, logits)
    held[0]  # a round that switched versions once the preparation was done: the commit goes back to v1 first
    held.commit(ready)  # then applies the prepared step (not a second read of the version)
    for v in (2, 0, 1, 2):
        assert bits(held[v][0]) == bits(alone(vs[v], fp8)), v
    stale = held.prepare(3, vs[3], b"\3" * 32)
    held.add(3, vs[3], b"\3" * 32)
    with pytest.raises(ValueError, match="prepared against v2"):
        held.commit(stale)
    held[0]
    with pytest.raises(ValueError, match="active v0"):
        held.prepare(4, vs[3], b"\4" * 32)
    assert bits(held[3][0]) == bits(alone(vs[3], fp8))


def test_dropping_a_version_between_two_held_ones_joins_their_steps():
    vs = versions()
    held = ResidentPolicies(alone(vs[0], "off"), 0, b"\0" * 32)
    for v in (1, 2, 3):
        held.add(v, vs[v], bytes([v]) * 32)
    held[1]  # active in the middle of the chain
    held.drop(1)
    held.drop(2)
    assert sorted(held) == [0, 3] and sorted(held.deltas) == [0, 3]
    for v in (0, 3, 0):
        assert bits(held[v][0]) == bits(alone(vs[v], "off")), v
    with pytest.raises(KeyError):
        held[1]


def test_a_version_with_a_missing_or_misshaped_tensor_is_refused_and_the_held_versions_stay_intact():
    vs = versions()
    held = ResidentPolicies(alone(vs[0], "off"), 0, b"\0" * 32)
    held.add(1, vs[1], b"\1" * 32)
    broken = dict(vs[2])
    broken.pop("model.norm.weight")
    with pytest.raises(InvalidCheckpoint, match="missing"):
        held.add(2, broken, b"\2" * 32)
    broken = dict(vs[2], **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(InvalidCheckpoint, match="shape"):
        held.add(2, broken, b"\2" * 32)
    assert sorted(held) == [0, 1]
    assert bits(held[0][0]) == bits(alone(vs[0], "off")) and bits(held[1][0]) == bits(alone(vs[1], "off"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("room", ["ample", "default", "none"])
def test_on_a_gpu_deltas_stay_on_the_device_while_it_has_room_and_every_version_is_that_version_alone(monkeypatch, room):
    import node.roles.resident_policy as rp

    if room == "ample":
        monkeypatch.setattr(rp, "DEVICE_DELTAS_SHARE", 100.0)
    if room == "none":
        monkeypatch.setattr(rp, "DEVICE_FREE_FLOOR", 1 << 60)
    vs = versions()
    on_gpu = lambda state: alone(state, "off").cuda()  # noqa: E731
    held = ResidentPolicies(on_gpu(vs[0]), 0, b"\0" * 32)
    for v in (1, 3, 2):
        held.add(v, vs[v], bytes([v]) * 32)
    where, model_bytes = held._held_bytes(), held._model_bytes
    if room == "ample":
        assert where.get("cuda", 0) > 0 and where.get("cpu", 0) == 0, where
    elif room == "none":
        assert where.get("cuda", 0) == 0 and where.get("cpu", 0) > 0, where
    else:  # v2 is a dense step: v0 and v1 held against v3 are whole copies, more than the device share allows
        assert 0 < where["cuda"] <= rp.DEVICE_DELTAS_SHARE * model_bytes < held.delta_bytes, (where, model_bytes)
    for v in (2, 0, 3, 1, 0):
        assert bits(held[v][0]) == bits(on_gpu(vs[v])), v
