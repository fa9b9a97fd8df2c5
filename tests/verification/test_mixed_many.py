"""Mixed-version rollouts recomputed together (`TorchReference.prefill_mixed_many`): the same results as
one by one, and on the validator's resident model one switch per version instead of two per rollout."""

import copy
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import rollouts as R  # noqa: E402

from node.model.checkpoint import state_dict_to_hf  # noqa: E402
from node.roles.resident_policy import ResidentPolicies  # noqa: E402
from verification.calibration.perturb import perturb  # noqa: E402
from verification.validator import _mixed_item, _plan, verify_claims  # noqa: E402


class CountedSwitches(Mapping):
    """A resident model's versions, counting each lookup that changes the active one (a chain walk)."""

    def __init__(self, held: ResidentPolicies):
        self.held, self.switches = held, 0

    def __getitem__(self, v):
        self.switches += v != self.held.active
        return self.held[v]

    def __iter__(self):
        return iter(self.held)

    def __len__(self):
        return len(self.held)


def resident_reference(policies: Mapping):
    from node.replay import TorchReference

    prompt_ids, reward = R.env_oracle(R.TOK)
    return TorchReference(policies, eos_id=R.TOK.eos_id, max_seq_len=R.MAX_SEQ, decode=R.TOK.decode,
                          tasks=prompt_ids, reward=reward)


def mixed_world(versions: int = 3):
    """Rollouts generated across `versions` - 1 swaps, and a resident model holding those versions."""
    model = R.tiny_model()
    states = [model]
    for v in range(1, versions):
        states.append(perturb(states[-1], "noise1pct", seed=v))
    engine = R.engine_for(copy.deepcopy(model))
    work = [(s, R.spec(s)) for s in range(16)]
    for s, sp in work:
        engine.add_request(R.request(s, sp))
    done = []
    for v in range(1, versions):
        for _ in range(6):
            done += engine.step()
        engine.load_weights({k: t.clone() for k, t in states[v].state_dict().items()}, version=v)
    while engine.has_work():
        done += engine.step()
    done.sort(key=lambda c: int(c.request_id[1:]))
    claims = R.claims_from(done, work)
    held = ResidentPolicies(copy.deepcopy(model).eval(), 0, R.manifest(0))
    for v in range(1, versions):
        held.add(v, state_dict_to_hf(states[v]), R.manifest(v))
    return states, claims, held


def _close(a, b) -> bool:
    """Equal to float32 rounding: a batched forward (rows of several lengths, padded) sums in another order
    than one row alone; the checks' bounds are orders of magnitude wider."""
    return all(x.shape == y.shape and torch.allclose(x, y, rtol=0, atol=1e-5) for x, y in zip(a, b))


def test_mixed_rollouts_recomputed_together_in_batches_are_those_recomputed_alone_and_switch_once_a_version():
    states, claims, held = mixed_world()
    mixed = [c for c in claims if len(set(c.versions)) > 1]
    assert len(mixed) >= 4 and any(len(set(c.versions)) == 3 for c in mixed)
    counted = CountedSwitches(held)
    ref = resident_reference(counted)
    items = [_mixed_item(c, _plan(c, ref)) for c in mixed]
    alone = [ref.prefill_mixed(*it[:2], logits_from=it[2]) for it in items]
    switches_alone, counted.switches = counted.switches, 0
    together = ref.prefill_mixed_many(items)
    assert all(_close(a, b) for a, b in zip(alone, together))
    assert counted.switches <= 3 < switches_alone, (counted.switches, switches_alone)
    # in batches: two rows of different lengths and starts, and one batch per version, give the same
    ref.batch_tokens = 1  # each sequence a batch of its own: the order of the sums of the path alone
    assert all(_close(a, b) for a, b in zip(alone, ref.prefill_mixed_many(items)))
    # a sequence whose versions do not rise (no engine makes one) is computed alone, with the same result
    seq, segments, start, replay = items[0]
    backwards = [(2 - v, a, b) for v, a, b in segments]
    odd = ref.prefill_mixed_many([items[1], (seq, backwards, start, replay)])
    assert _close(odd[0], together[1])
    assert all(torch.equal(x, y) for x, y in zip(odd[1], ref.prefill_mixed(seq, backwards, logits_from=start)))


def test_the_validator_accepts_honest_mixed_rollouts_and_rejects_a_relabelled_one_on_the_resident_model():
    _, claims, held = mixed_world()
    ref = resident_reference(held)
    measured = []
    measure = ref.measure_tokens
    ref.measure_tokens = lambda logits, *a: measured.append(len(logits)) or measure(logits, *a)
    verdicts = verify_claims(claims, ref)
    assert all(v.accepted for v in verdicts), [v.detail for v in verdicts if not v.accepted]
    # the mixed claims' segments measured in one pass (one transfer back), not one a claim
    mixed_segments = sum(len(set(c.versions)) for c in claims if len(set(c.versions)) > 1)
    assert mixed_segments in measured and len(measured) <= 2, measured
    ref.measure_tokens = measure
    mixed = [c for c in claims if len(set(c.versions)) > 1]
    cheat = R.relabel(mixed[:1], 2)[0]  # every token claimed as the newest version
    verdicts = verify_claims([cheat, *mixed[1:3]], ref)
    assert [v.accepted for v in verdicts] == [False, True, True], [v.detail for v in verdicts]


def test_a_mixed_claim_the_batch_fails_is_recomputed_alone_and_only_that_verdict_stands(caplog):
    """The batched recomputation's failure is confirmed on the claim's own one-row path before it counts: a
    batch that came out wrong (here: hidden states shifted) costs no honest claim, and one that the one-row
    path fails too is rejected."""
    _, claims, held = mixed_world()
    mixed = [c for c in claims if len(set(c.versions)) > 1][:4]
    ref = resident_reference(held)
    batched = ref.prefill_mixed_many

    def shifted(items, **kw):
        return [(out[0], out[1] + 1.0, *out[2:]) for out in batched(items, **kw)]

    ref.prefill_mixed_many = shifted
    verdicts = verify_claims(mixed, ref)
    assert all(v.accepted for v in verdicts), [v.detail for v in verdicts]
    assert "passed alone: the batch's verdict is dropped" in caplog.text
    alone = ref.prefill_mixed
    ref.prefill_mixed = lambda *a, **kw: (lambda out: (out[0], out[1] + 1.0, *out[2:]))(alone(*a, **kw))
    verdicts = verify_claims(mixed, ref)
    assert not any(v.accepted for v in verdicts), "a failure the one-row path confirms stands"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_mixed_rollouts_recomputed_in_batches_are_those_recomputed_alone_and_pass():
    """The validator's GPU path (its resident model on the device, float32 without TF32): the batched mixed
    recomputation against the one-row one, and every honest mixed claim accepted. (One GPU run of the batched
    path banned an honest node, cause not found: docs/scale.md, session 26; this says whether the batch did.)"""
    states, claims, _ = mixed_world()
    held = ResidentPolicies(copy.deepcopy(states[0]).cuda().eval(), 0, R.manifest(0))
    for v in range(1, len(states)):
        held.add(v, state_dict_to_hf(states[v]), R.manifest(v))
    ref = resident_reference(held)
    assert ref.on_device
    mixed = [c for c in claims if len(set(c.versions)) > 1]
    items = [_mixed_item(c, _plan(c, ref)) for c in mixed]
    alone = [ref.prefill_mixed(*it[:2], logits_from=it[2]) for it in items]
    together = ref.prefill_mixed_many(items)
    worst = max(float((x - y).abs().max()) for a, b in zip(alone, together) for x, y in zip(a, b))
    assert all(_close(a, b) for a, b in zip(alone, together)), worst
    verdicts = verify_claims(claims, ref)
    assert all(v.accepted for v in verdicts), [v.detail for v in verdicts if not v.accepted]


def test_a_sequence_computed_in_packed_parts_is_the_sequence_whole():
    """`PackedKV.part`: parts of sequences end to end in one forward, each at its own positions over the keys its
    sequence's earlier parts wrote (the parts of one forward in any order), give each sequence's rows whole."""
    from node.model.packed import PackedKV

    model = R.tiny_model()
    cfg = model.config
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (9, 5, 12)]
    kv = PackedKV(cfg.num_hidden_layers, [len(s) for s in seqs], cfg.num_key_value_heads, cfg.head_dim,
                  torch.float32, "cpu")
    rows: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    with torch.no_grad():
        for spans in ([(0, 0, 4), (1, 0, 5), (2, 0, 3)], [(2, 3, 7), (0, 4, 9)], [(2, 7, 12)]):
            packed = kv.part(spans)
            out = model(torch.cat([seqs[j][a:b] for j, a, b in spans])[None], packed=packed)
            start = 0
            for j, a, b in spans:
                rows[j].append(out.logits[0, start : start + b - a])
                start += b - a
        for j, s in enumerate(seqs):
            whole = model(s[None]).logits[0]
            assert torch.allclose(torch.cat(rows[j]), whole, atol=1e-5), (j, (torch.cat(rows[j]) - whole).abs().max())
        with pytest.raises(ValueError, match=r"part \[3, 6\) of a packed sequence of 5 tokens"):
            kv.part([(1, 3, 6)])
        from node.model.cache import KVCache

        with pytest.raises(ValueError, match="PackedKV"):
            model(seqs[1][None], cache=KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, 8, cfg.head_dim),
                  slots=torch.zeros(1, dtype=torch.long), packed=kv.part([(1, 0, 5)]))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_mixed_rollouts_recomputed_packed_are_those_recomputed_padded(device, monkeypatch):
    """`prefill_mixed_many` packed (`_PackedMixed`: a GPU's way in bf16; on the CPU forced, its attention a loop over
    sequences) against the same claims padded (`_MixedBatch`): every claim's logits, hidden states, routes and router
    logits, within the dtype's rounding, with routes replayed (the validator's way for a routed claim) and, on the
    CPU, routed freely; one forward per version, each a packed part over the keys of the versions before."""
    import node.replay as replay_mod
    from node.model.packed import continued_usable

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    states, claims, _ = mixed_world()
    models = [copy.deepcopy(m).to(device, dtype).eval() for m in states]
    ref = resident_reference({v: (m, R.manifest(v)) for v, m in enumerate(models)})
    free = [_mixed_item(c, _plan(c, ref)) for c in claims if len(set(c.versions)) > 1]
    monkeypatch.setenv("PRIMERL_JUDGE_PACKED", "0")
    padded_free = ref.prefill_mixed_many(free, with_routes=True, with_router_logits=True)
    replayed = [(*it[:3], out[2]) for it, out in zip(free, padded_free)]  # the routes the padded forwards chose
    padded = ref.prefill_mixed_many(replayed, with_routes=True, with_router_logits=True)
    monkeypatch.delenv("PRIMERL_JUDGE_PACKED")
    if device == "cpu":
        assert not replay_mod.packing(ref.device, ref.param_dtype, continued=True)  # the CPU pads unless told
        monkeypatch.setattr(replay_mod, "packing", lambda *_, **__: True)
    else:
        assert continued_usable(ref.device, dtype)  # bottom-right causal alignment, checked on this GPU
    ref.packed_tokens = 10_000  # one group: one forward per version
    forwards: list = []
    hooks = [m.register_forward_hook(lambda _m, args, kwargs, out: forwards.append(kwargs.get("packed")),
                                     with_kwargs=True) for m in models]
    try:
        packed = ref.prefill_mixed_many(replayed, with_routes=True, with_router_logits=True)
        pairs = [(padded, packed)]
        if device == "cpu":  # routed freely, in float32 the same experts are chosen
            pairs.append((padded_free, ref.prefill_mixed_many(free, with_routes=True, with_router_logits=True)))
    finally:
        for h in hooks:
            h.remove()
    assert len(forwards) == 3 * len(pairs) and all(p is not None and p.context is not None for p in forwards)
    tol = 1e-5 if dtype == torch.float32 else 0.05
    for want, got in pairs:
        for i, (a, b) in enumerate(zip(want, got)):
            assert a[0].shape == b[0].shape and a[1].shape == b[1].shape, i
            for x, y in ((a[0], b[0]), (a[1], b[1]), (a[3], b[3])):
                assert torch.allclose(x.float().cpu(), y.float().cpu(), atol=tol, rtol=tol), (
                    i, (x.float().cpu() - y.float().cpu()).abs().max())
            assert torch.equal(a[2], b[2])
    assert all(torch.equal(b[2], it[3]) for b, it in zip(packed, replayed))
