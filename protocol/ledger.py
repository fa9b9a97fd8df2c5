"""The off-policy ledger: a rollout never enters a batch more than k policy versions behind.

Versions: the trainer's step s produces policy version s. A batch for step s is built while
version s-1 is the newest, so the lag of a rollout in it is (s - 1) - min_version, where
min_version is the oldest version that produced any of its tokens. The bound is lag <= k
(`max_off_policy_steps`): k = 0 is synchronous RL (only the newest policy's rollouts).

Two checks keep the bound, and both stay: the coordinator refuses a submission that is already
too stale for the next batch (saving its storage and the validator's time), and the batch
builder checks again, because versions move on between acceptance and batching. Work that can no
longer finish in time is cancelled early to save inference compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import StaleRollout


@dataclass
class OffPolicyLedger:
    max_off_policy_steps: int
    """k: the largest lag a rollout may have when it enters a batch."""
    current_version: int = -1
    """Newest published policy version (-1 before the first)."""

    def lag(self, min_version: int, step: int | None = None) -> int:
        """Versions between a rollout's oldest token and the policy a batch for `step` trains."""
        step = self.current_version + 1 if step is None else step
        return (step - 1) - min_version

    def admissible(self, min_version: int, step: int | None = None) -> bool:
        return self.lag(min_version, step) <= self.max_off_policy_steps

    def check_submission(self, min_version: int) -> None:
        """Raise `StaleRollout` unless the rollout could still enter the next batch."""
        if min_version > self.current_version:
            raise StaleRollout(f"claims policy version {min_version}, newest is {self.current_version}")
        if not self.admissible(min_version):
            raise StaleRollout(f"oldest token from version {min_version}, next batch trains on "
                               f"{self.current_version}: lag {self.lag(min_version)} > k={self.max_off_policy_steps}")

    def lease_can_finish(self, lease_version: int) -> bool:
        """A lease minted at `lease_version` can still yield an admissible rollout."""
        return self.admissible(lease_version)

    def advance(self, version: int) -> None:
        if version <= self.current_version:
            raise ValueError(f"policy version {version} does not advance {self.current_version}")
        self.current_version = version
