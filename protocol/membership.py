"""Who is in the run, as seen from one node: joins, heartbeats, graceful leaves, deaths.

Invariant: a member that has missed `dead_after_missed` heartbeats is reported dead exactly once
by `sweep` and leaves the view (ejected); a later heartbeat from it is a fresh sighting (it must
re-join at the coordinator to get work again). A beat is "missed" once half an interval of slack
has passed after it was due, so scheduling jitter does not count as a miss. A member's first beat
is due from when it joined (or, after a restart, from when the view was rebuilt), with
`FIRST_BEAT_GRACE` times the usual allowance: a slow start (loading a model, compiling) is not death.
Two views fed the same gossip converge: the state of a peer depends only on its last beat time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

MemberState = Literal["alive", "unhealthy", "dead"]


@dataclass(frozen=True)
class MembershipConfig:
    heartbeat_interval_s: float = 10.0
    """How often members beat (Prime Intellect's protocol uses 10 s)."""
    dead_after_missed: int = 3
    """Missed beats until dead and ejected (3, as in that protocol)."""


FIRST_BEAT_GRACE = 2
"""A member that has not beaten since it joined is dead after this many times `dead_after_missed`
intervals from its join (the sim's validator, ejected 33 s after joining while it loaded its first
policy under load 6-10 on 2 cores, issue 28)."""


@dataclass
class Member:
    peer_id: str
    role: str
    addrs: list[str] = field(default_factory=list)
    last_seen: float = 0.0
    last_seq: int = -1
    joined_at: float = 0.0
    """When this view first saw it (its join, or the view's rebuild after a restart)."""
    beats: int = 0
    """Heartbeats seen since then."""


class MembershipView:
    def __init__(self, config: MembershipConfig):
        self.config = config
        self.members: dict[str, Member] = {}

    def missed(self, peer_id: str, now: float) -> int:
        m = self.members[peer_id]
        return max(0, math.floor((now - m.last_seen) / self.config.heartbeat_interval_s - 0.5))

    def allowed_missed(self, peer_id: str) -> int:
        """Missed beats after which the member is dead: more before its first beat (`FIRST_BEAT_GRACE`)."""
        first = self.members[peer_id].beats == 0
        return self.config.dead_after_missed * (FIRST_BEAT_GRACE if first else 1)

    def state(self, peer_id: str, now: float) -> MemberState:
        if peer_id not in self.members:
            return "dead"
        missed = self.missed(peer_id, now)
        if missed >= self.allowed_missed(peer_id):
            return "dead"
        return "unhealthy" if missed >= 1 else "alive"

    def observe(self, peer_id: str, role: str, addrs: list[str], seq: int, now: float) -> bool:
        """Record a join or heartbeat; returns True when the peer is new to this view."""
        m = self.members.get(peer_id)
        if m is None:
            self.members[peer_id] = Member(peer_id, role, list(addrs), now, seq, joined_at=now)
            return True
        if seq < m.last_seq:  # reordered gossip: an older beat says nothing new
            return False
        m.role, m.addrs, m.last_seen, m.last_seq = role, list(addrs), now, seq
        m.beats += 1
        return False

    def touch(self, peer_id: str, now: float) -> None:
        """A signed request from a member is as good a sign of life as a heartbeat: after a coordinator
        restart a member's gossip may not reach it for a while when its requests do (a walk-through
        ejected an inference node that was submitting, and its leased work was lost)."""
        m = self.members.get(peer_id)
        if m is not None:
            m.last_seen = max(m.last_seen, now)

    def leave(self, peer_id: str) -> bool:
        return self.members.pop(peer_id, None) is not None

    def sweep(self, now: float) -> list[str]:
        """Eject and return the members that are dead now."""
        return [m.peer_id for m in self.sweep_members(now)]

    def sweep_members(self, now: float) -> list[Member]:
        """Eject and return the members that are dead now, as they were last seen."""
        dead = [m for p, m in self.members.items() if self.state(p, now) == "dead"]
        for m in dead:
            del self.members[m.peer_id]
        return dead

    def alive(self, now: float) -> list[Member]:
        return [m for p, m in self.members.items() if self.state(p, now) != "dead"]
