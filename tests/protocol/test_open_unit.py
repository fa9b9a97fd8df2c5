"""Accepted work units reach the trainer and the validator opened in one place (`protocol.work.open_unit`):
an honest unit is its signer's rollout group; bytes that do not verify for the run, and a signed message of
another shape than the run's groups, are an `UnreadableUnit` carrying the typed error, never an exception
that would stop the role."""

from __future__ import annotations

from protocol.envelope import seal
from protocol.errors import InvalidSignature, MalformedMessage, MalformedWork, WrongRun
from protocol.identity import NodeKey
from protocol.messages import Ok, RolloutGroup, RolloutSubmission, StoredWork
from protocol.work import AcceptedGroup, UnreadableUnit, open_unit

KEY = NodeKey.from_seed(b"u" * 32)
RUN = "open-unit"


def rollout(work_id: int = 9) -> RolloutSubmission:
    return RolloutSubmission(work_id=work_id, version_runs=[(0, 3)], token_ids=[4, 5, 6], logprobs=[-0.5] * 3,
                             reward=1.0, finish_reason="eos")


def stored(envelope: bytes, work_id: int = 9) -> StoredWork:
    return StoredWork(work_id=work_id, task_index=4, seed=77, envelope=envelope)


def test_an_honest_unit_opens_to_its_signers_group_and_a_bare_rollout_only_where_groups_have_one():
    group = RolloutGroup(work_id=9, rollouts=[rollout(), rollout()])
    assert open_unit(stored(seal(KEY, RUN, group)), RUN, 2) == AcceptedGroup(9, 4, 77, KEY.peer_id, group)
    one = open_unit(stored(seal(KEY, RUN, rollout())), RUN, 1)
    assert one == AcceptedGroup(9, 4, 77, KEY.peer_id, RolloutGroup(work_id=9, rollouts=[rollout()]))


def test_a_unit_that_does_not_open_is_unreadable_with_its_typed_error():
    group = RolloutGroup(work_id=9, rollouts=[rollout(), rollout()])
    signed = seal(KEY, RUN, group)
    tampered = bytearray(signed)
    tampered[-80] ^= 1  # inside the body: the signature no longer covers it
    unsigned = {  # the signature is what fails: nobody can be named
        "junk bytes": (b"\x00" * 64, MalformedMessage),
        "another run": (seal(KEY, "another-run", group), WrongRun),
        "tampered": (bytes(tampered), InvalidSignature),
    }
    for what, (envelope, error) in unsigned.items():
        got = open_unit(stored(envelope), RUN, 2)
        assert isinstance(got, UnreadableUnit) and isinstance(got.error, error), (what, got)
        assert got.work_id == 9 and got.submitter == "?", what
    shapes = {  # signed, but not what the run trains on: its signer is named
        "not a rollout": seal(KEY, RUN, Ok()),
        "bare rollout in a run of pairs": seal(KEY, RUN, rollout()),
        "group of another size": seal(KEY, RUN, RolloutGroup(work_id=9, rollouts=[rollout()])),
        "another unit's group": seal(KEY, RUN, RolloutGroup(work_id=8, rollouts=[rollout(8), rollout(8)])),
    }
    for what, envelope in shapes.items():
        got = open_unit(stored(envelope), RUN, 2)
        assert isinstance(got, UnreadableUnit) and isinstance(got.error, MalformedWork), (what, got)
        assert got.submitter == KEY.peer_id, what
