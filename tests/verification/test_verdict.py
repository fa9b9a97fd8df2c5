import pytest

from protocol.errors import InvalidSignature
from protocol.identity import NodeKey
from verification.checks import Reason
from verification.verdict import Verdict, detection_probability, selected_for_verification


def _verdict(**kw) -> Verdict:
    base = dict(work_id=7, claim_digest="ab" * 32, accepted=False, reason=Reason.HIDDEN_MISMATCH, chunk=2)
    return Verdict(**{**base, **kw})


def test_signed_verdict_verifies_and_any_edit_breaks_it():
    key = NodeKey.from_seed(b"\x07" * 32)
    v = _verdict().signed(key)
    v.check_signature()
    assert v.validator == key.peer_id
    for edit in ({"accepted": True}, {"chunk": 3}, {"reason": Reason.OK}, {"work_id": 8}):
        with pytest.raises(InvalidSignature):
            v.model_copy(update=edit).check_signature()
    other = NodeKey.from_seed(b"\x08" * 32)
    with pytest.raises(InvalidSignature):  # key swapped in but peer id left: refused
        v.model_copy(update={"public_key": other.public_bytes.hex()}).check_signature()
    assert Verdict.model_validate_json(v.model_dump_json()) == v


def test_sampling_rate_selects_about_that_share_and_is_keyed():
    picks = [selected_for_verification(w, 0.1, b"secret") for w in range(20_000)]
    assert 0.09 < sum(picks) / len(picks) < 0.11
    assert picks != [selected_for_verification(w, 0.1, b"other") for w in range(20_000)]
    assert all(selected_for_verification(w, 1.0, b"s") for w in range(10))


def test_detection_probability_matches_the_geometric_formula():
    assert detection_probability(0.1, 10) == pytest.approx(1 - 0.9**10)
    assert detection_probability(0.1, 50) > 0.99
    assert detection_probability(1.0, 1) == 1.0
