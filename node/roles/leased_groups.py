"""The rollout groups an inference node's engine is playing, one per admitted lease.

A work id is not a key here: the coordinator may cancel a stale lease and re-grant the same work to the
same node while the cancelled copy still runs in the engine. Each admission is its own group (its own
episode ids), so the two copies never mix; the cancelled one finishes and is dropped at submission
(`CoordinatorClient.lease_cancelled` tells the leases apart by version), the re-grant is submitted.
"""

from __future__ import annotations

import itertools

from node.engine import SamplingParams
from node.envs.rollout import Episodes, Rollout
from node.envs.base import Task
from protocol.messages import LeaseGrant
from protocol.work import sampling_seed


class LeasedGroups:
    """Groups in flight on `episodes`: `admit` starts a lease's `group_size` episodes, `finished` files
    the rollouts an engine step returned and gives back each group that is now whole, with its grant."""

    def __init__(self, episodes: Episodes, group_size: int, temperature: float):
        self.episodes, self.group_size, self.temperature = episodes, group_size, temperature
        self._open: dict[str, tuple[LeaseGrant, list[Rollout | None]]] = {}
        self._serial = itertools.count()

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, grant: LeaseGrant, task: Task) -> None:
        key = f"{grant.work_id}.{next(self._serial)}"
        self._open[key] = (grant, [None] * self.group_size)
        for j in range(self.group_size):
            self.episodes.add(f"{key}-{j}", task,
                              SamplingParams(temperature=self.temperature, seed=sampling_seed(grant.seed, j)))

    def finished(self, rollouts: list[Rollout]) -> list[tuple[LeaseGrant, list[Rollout]]]:
        whole = []
        for rollout in rollouts:
            key, j = rollout.episode_id.rsplit("-", 1)
            grant, members = self._open[key]
            members[int(j)] = rollout
            if all(m is not None for m in members):
                del self._open[key]
                whole.append((grant, members))
        return whole
