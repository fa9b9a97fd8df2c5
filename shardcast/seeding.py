"""Super-seeding at an origin: hand each shard out a few times, then let peers spread it.

A trainer's origin is the one uplink every node competes for. Serving each request as it comes,
it spends its whole uplink on copies peers could have made: a 100-node simulation had it send
14-26x the version's bytes (`benchmarks.swarm_sim`). With `SeedOffer`, the origin's `/have`
lists only shards handed out fewer than `copies` times in this version, and a request for any
other shard gets 425 (Too Early: "fetch it from a peer") unless the client marks it a last resort,
which a fetcher does only when no source it knows holds or is fetching a shard it still needs
for `STARVE_S` (`sources.ShardSchedule`), e.g. because the one node that got the copy left.
Pure and clock-free, so the real server and the swarm simulator run the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_SEED_COPIES = 1
"""Copies of each shard an origin hands out before it hides the shard: one is enough when peers
list each other; a node that leaves with the only copy costs a last-resort request."""


@dataclass
class SeedOffer:
    copies: int = DEFAULT_SEED_COPIES
    """Hand-outs per shard per version before the shard is hidden from `/have`."""
    served: dict[tuple[str, int], dict[int, int]] = field(default_factory=dict)
    """(run, version) -> shard -> times handed out."""

    def offered(self, run: str, version: int, held: list[int]) -> list[int]:
        """The held shards this origin still offers to anyone."""
        counts = self.served.get((run, version), {})
        return [i for i in held if counts.get(i, 0) < self.copies]

    def admit(self, run: str, version: int, index: int, last_resort: bool) -> bool:
        """Whether to send shard `index` now; counts the hand-out when it does."""
        counts = self.served.setdefault((run, version), {})
        if counts.get(index, 0) >= self.copies and not last_resort:
            return False
        counts[index] = counts.get(index, 0) + 1
        if len(self.served) > 8:  # keep the few newest versions only
            del self.served[min(self.served, key=lambda k: k[1])]
        return True
