"""The trainer never dies on data (issue 29, attack 3): each unit of a batch is checked before it enters
a step, and one the step could not read raises the typed `UnitRejected` (reported, dropped, the step
goes on: tests/node/test_junk_network.py), while an honest unit passes and builds the step's batch."""

from __future__ import annotations

import pytest

from node.roles.trainer import TrainerNode, UnitRejected
from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.messages import RolloutGroup, RolloutSubmission, RunSpec, StoredWork
from protocol.work import AcceptedGroup, OpenedUnit, UnreadableUnit, open_unit

KEY = NodeKey.from_seed(b"s" * 32)
SPEC = RunSpec(run_id="checks", coordinator=NodeKey.from_seed(b"c" * 32).peer_id, environment="reverse",
               group_size=2, max_off_policy_steps=1)


def rollout(versions: list[int], tokens: list[int] | None = None) -> RolloutSubmission:
    tokens = tokens or [5 + i for i in range(len(versions))]
    return RolloutSubmission(work_id=3, version_runs=RolloutSubmission.runs_of(versions), token_ids=tokens,
                             logprobs=[-0.5] * len(tokens), reward=0.0, finish_reason="length")


def item(message) -> OpenedUnit:
    """The unit as the trainer's client hands it over (`CoordinatorClient.batch`)."""
    stored = StoredWork(work_id=3, task_index=11, seed=5, envelope=seal(KEY, SPEC.run_id, message))
    return open_unit(stored, SPEC.run_id, SPEC.group_size)


def test_a_unit_the_step_could_not_read_is_rejected_and_an_honest_one_passes(tmp_path):
    role = TrainerNode(NodeKey.generate(), SPEC, "", tmp_path, 0)
    role.ledger.current_version = 4
    honest = RolloutGroup(work_id=3, rollouts=[rollout([4, 4, 4])] * 2)
    unit = role._open(5, item(honest))
    assert unit == AcceptedGroup(work_id=3, task_index=11, seed=5, submitter=KEY.peer_id, group=honest)
    batch, rewards = role.train_batch([unit])
    assert rewards.shape == (1, 2) and batch.input_ids.shape[0] == 2
    vocab, longest = role._shape.vocab_size, role._shape.max_position_embeddings
    junk = {
        "bare rollout": rollout([4, 4, 4]),
        "group of 1": RolloutGroup(work_id=3, rollouts=[rollout([4, 4, 4])]),
        "another work id": RolloutGroup(work_id=4, rollouts=[rollout([4, 4, 4]).model_copy(update={"work_id": 4})] * 2),
        "version of the future": RolloutGroup(work_id=3, rollouts=[rollout([4, 4, 5])] * 2),
        "too stale": RolloutGroup(work_id=3, rollouts=[rollout([2, 4, 4])] * 2),
        "token outside the vocabulary": RolloutGroup(work_id=3, rollouts=[rollout([4, 4], [5, vocab])] * 2),
        "longer than the model holds": RolloutGroup(work_id=3, rollouts=[rollout([4] * longest)] * 2),
    }
    for what, message in junk.items():
        with pytest.raises(UnitRejected):
            role._open(5, item(message))
            raise AssertionError(f"{what} was not rejected")
    junk_bytes = open_unit(StoredWork(work_id=3, task_index=11, seed=5, envelope=b"\x00" * 64), SPEC.run_id,
                           SPEC.group_size)  # bytes that are no signed message at all
    assert isinstance(junk_bytes, UnreadableUnit) and junk_bytes.submitter == "?"
    with pytest.raises(UnitRejected, match="MalformedMessage"):
        role._open(5, junk_bytes)
