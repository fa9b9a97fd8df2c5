"""A validator's round holds only the logits verification needs: the completion's rows (never the
prompt's), copied out of the prefill batch, and a version's claims are prefilled in groups whose
logits stay under `PREFILL_LOGITS_BYTES` (a 49k-151k vocabulary made a round's [T, V] logits
gigabytes). Verdicts are those of the full recomputation."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import rollouts as R  # noqa: E402

import verification.validator as validator  # noqa: E402
from verification.validator import verify_claims  # noqa: E402

SEEDS = list(range(24))


@pytest.fixture(scope="module")
def world():
    model = R.tiny_model()
    work = [(s, R.spec(s, temperature=0.0 if s % 3 == 0 else 1.0)) for s in SEEDS]
    return model, R.claims_from(R.generate(R.engine_for(model), work), work)


def test_prefill_hands_back_only_the_rows_asked_for_as_copies(world):
    model, claims = world
    ref = R.reference({0: model})
    seqs = [c.prompt_ids + c.token_ids[:-1] for c in claims]
    starts = [len(c.prompt_ids) - 1 for c in claims]
    full = ref.prefill(0, seqs)
    part = ref.prefill(0, seqs, logits_from=starts)
    for seq, start, (lf, hf), (lp, hp) in zip(seqs, starts, full, part):
        assert lp.shape == (len(seq) - start, ref.vocab_size) and hp.shape == hf.shape
        assert torch.allclose(lp, lf[start:], atol=1e-5) and torch.equal(hp, hf)
        # its own storage: a view would keep the whole batch's [B, T, V] logits alive
        assert lp.untyped_storage().nbytes() == lp.numel() * lp.element_size()
    (lm, hm) = ref.prefill_mixed(seqs[0], [(0, 0, len(seqs[0]))], logits_from=starts[0])
    assert lm.shape[0] == len(seqs[0]) - starts[0] and torch.allclose(lm, full[0][0][starts[0]:], atol=1e-5)


def test_a_round_is_checked_in_bounded_groups_with_the_same_verdicts(world, monkeypatch):
    model, claims = world
    ref = R.reference({0: model})
    tokens = [len(c.token_ids) for c in claims]
    tampered = list(claims)
    t = list(claims[5].token_ids)
    t[2] = (t[2] + 5) % R.TOK.vocab_size if t[2] != R.TOK.eos_id else 10
    tampered[5] = claims[5].model_copy(update={"token_ids": t})
    unbounded = verify_claims(tampered, ref)
    assert [v.accepted for v in unbounded] == [i != 5 for i in range(len(claims))]

    held: list[int] = []
    prefill = ref.prefill

    def recording(*args, **kwargs):
        out = prefill(*args, **kwargs)
        held.append(sum(o[0].numel() * o[0].element_size() for o in out))
        return out

    budget = 4 * ref.vocab_size * 3 * max(tokens)  # about 3 claims' completions per group
    monkeypatch.setattr(validator, "PREFILL_LOGITS_BYTES", budget)
    monkeypatch.setattr(ref, "prefill", recording)
    bounded = verify_claims(tampered, ref)
    assert [(v.accepted, v.reason) for v in bounded] == [(v.accepted, v.reason) for v in unbounded]
    assert len(held) >= len(claims) // 3 and max(held) <= budget
    assert sum(held) == 4 * ref.vocab_size * sum(tokens)  # completion rows only, each claim's once
