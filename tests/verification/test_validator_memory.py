"""A recomputation that raises is tried again in halves, down to one claim (`verification.validator._halves_after`):
a group too large for the validator's memory is judged in smaller ones, a claim that does not fit even alone is
`unjudged` (no strike), and a claim that makes the reference fail fails alone, not every claim recomputed
beside it (other submitters' too).

`TightReference` is a named fake for a GPU that is short of memory (this machine has none to run out of): the
real `TorchReference`, except that a recomputation of more than `fits` sequences raises what a CUDA allocation
that does not fit raises (`torch.OutOfMemoryError`), and one holding a `poison` sequence raises a plain error
(what a claim that trips the reference would do)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import rollouts as R  # noqa: E402

from node.replay import TorchReference, env_oracle  # noqa: E402
from verification.checks import Reason, Severity  # noqa: E402
from verification.validator import verify_claims  # noqa: E402


class TightReference(TorchReference):
    def __init__(self, policies, fits: int, poison: list[int] | None = None):
        prompt_ids, reward = env_oracle(R.TOK)
        super().__init__(policies, eos_id=R.TOK.eos_id, max_seq_len=R.MAX_SEQ, decode=R.TOK.decode,
                         tasks=prompt_ids, reward=reward)
        self.fits, self.poison, self.sizes = fits, poison, []

    def _admit(self, sequences: list[list[int]]) -> None:
        self.sizes.append(len(sequences))
        if self.poison is not None and self.poison in sequences:
            raise RuntimeError("the reference tripped on this sequence")
        if len(sequences) > self.fits:
            raise torch.OutOfMemoryError(f"CUDA out of memory: {len(sequences)} sequences, room for {self.fits}")

    def prefill(self, version, sequences, *args, **kwargs):
        self._admit(sequences)
        return super().prefill(version, sequences, *args, **kwargs)

    def prefill_mixed_many(self, items, *args, **kwargs):
        self._admit([seq for seq, *_ in items])
        return super().prefill_mixed_many(items, *args, **kwargs)


def honest_claims(n: int = 12):
    model = R.tiny_model()
    work = [(s, R.spec(s, max_new_tokens=12 + s % 9)) for s in range(900, 900 + n)]
    return model, R.claims_from(R.generate(R.engine_for(model, max_batch=8), work), work)


def tampered(claim):
    """The same rollout with its logprobs claimed 0.7 higher: a cheat the recomputation catches."""
    return claim.model_copy(update={"logprobs": [lp + 0.7 for lp in claim.logprobs]})


def test_a_group_too_large_for_memory_is_judged_in_halves_and_judged_the_same():
    model, claims = honest_claims()
    claims[5] = tampered(claims[5])
    roomy = verify_claims(claims, R.reference({0: model}))
    assert [v.accepted for v in roomy] == [i != 5 for i in range(len(claims))]
    tight = TightReference({0: (model, R.manifest(0))}, fits=3)
    verdicts = verify_claims(claims, tight)
    assert tight.sizes[0] == len(claims) and max(s for s in tight.sizes if s <= 3) <= 3 and len(tight.sizes) > 4
    assert [(v.accepted, v.reason) for v in verdicts] == [(v.accepted, v.reason) for v in roomy]
    assert verdicts[5].reason == Reason.LOGPROB_MISMATCH  # the cheat is caught in a half as it is whole


def test_a_claim_that_does_not_fit_even_alone_is_unjudged_never_rejected():
    model, claims = honest_claims(6)
    verdicts = verify_claims(claims, TightReference({0: (model, R.manifest(0))}, fits=0))
    assert all(not v.accepted and v.reason == Reason.UNJUDGED and v.severity == Severity.NONE for v in verdicts)
    assert all("out of memory" in v.detail for v in verdicts)


def test_a_claim_that_makes_the_reference_fail_fails_alone():
    model, claims = honest_claims()
    bad = claims[7]
    ref = TightReference({0: (model, R.manifest(0))}, fits=len(claims), poison=bad.prompt_ids + bad.token_ids[:-1])
    verdicts = verify_claims(claims, ref)
    assert [v.accepted for v in verdicts] == [i != 7 for i in range(len(claims))]
    assert verdicts[7].reason == Reason.MALFORMED and verdicts[7].severity == Severity.PROOF
    assert len(ref.sizes) <= 1 + 2 * 4  # whole, then two halves a level down to the one claim (12 -> 1: 4 levels)


def test_mixed_version_claims_too_many_for_memory_are_judged_in_halves():
    from test_mixed_many import mixed_world

    _, claims, held = mixed_world()
    mixed = [c for c in claims if len(set(c.versions)) > 1]
    assert len(mixed) >= 4
    tight = TightReference(held, fits=2)
    verdicts = verify_claims(mixed, tight)
    assert all(v.accepted for v in verdicts), [(v.reason, v.detail) for v in verdicts if not v.accepted]
    assert tight.sizes[0] == len(mixed) and 0 < min(tight.sizes) <= 2
