"""Adversarial inference nodes for `primerl-node sim --cheaters K` and benchmarks.chaos.

A cheater is an honest `InferenceNode` with one hook installed (`InferenceNode.before_submit`):
half of its groups have their first rollout tampered with, in one of the ways verification's
attack classes cover: a flipped reward, a changed token, or a claimed policy version other than the
one that produced the tokens. The validator must catch every one (and the coordinator ban the node);
the honest role holds no cheating code.

A junk node (`JUNK` kinds, issue 29) sends what must never reach a trainer step: a group claiming a
policy version from the future for its last token, a token outside the vocabulary, a bare rollout
where the run expects a group, or a group one rollout short. The coordinator refuses what it can
judge at admission and strikes the sender; the trainer drops what gets through and reports it.

    python -m node.adversary --cheat {reward,tokens,version,mixed,future,vocab,bare,short} join --role inference ...
"""

from __future__ import annotations

import argparse
import random
import sys

from protocol.messages import RolloutGroup, RolloutSubmission

CHEATS = ("reward", "tokens", "version")
"""Tampering kinds; "mixed" draws one of them per tampered group."""
JUNK = ("future", "vocab", "bare", "short")
"""Junk kinds (never drawn by "mixed"): see the module docstring."""
TAMPERED_SHARE = 0.5
"""Share of a cheater's groups it tampers with."""


def tamper(sub: RolloutSubmission, kind: str, newest: int) -> RolloutSubmission:
    if kind == "reward":
        return sub.model_copy(update={"reward": 1.0 if sub.reward < 1.0 else 0.0})
    if kind == "tokens":
        toks = list(sub.token_ids)
        toks[0] = (toks[0] + 7) % 80 + 4
        return sub.model_copy(update={"token_ids": toks})
    # "version": claim the tokens came from another policy version than the one that made them
    other = newest - 1 if sub.min_version == newest else newest
    return sub.model_copy(update={"version_runs": [(max(0, other), sub.n_tokens)]})


class BareRollout(RolloutSubmission):
    """A bare rollout on the wire (`type` rollout_submission) that the inference role's own bookkeeping
    can still read as a group of one (it counts `group.rollouts`)."""

    @property
    def rollouts(self) -> list[RolloutSubmission]:
        return [self]


def junk(group: RolloutGroup, kind: str, newest: int) -> RolloutGroup | RolloutSubmission:
    first = group.rollouts[0]
    if kind == "future":  # real versions for the first tokens, one nobody published for the last
        versions = first.token_versions[:-1] + [newest + 1000]
        first = first.model_copy(update={"version_runs": RolloutSubmission.runs_of(versions)})
    elif kind == "vocab":
        first = first.model_copy(update={"token_ids": [*first.token_ids[:-1], (1 << 31) - 1]})
    elif kind == "bare":
        return BareRollout(**first.model_dump())
    elif kind == "short":
        return RolloutGroup(work_id=group.work_id, rollouts=group.rollouts[:-1] or [first, first])
    return RolloutGroup(work_id=group.work_id, rollouts=[first, *group.rollouts[1:]])


class Cheater:
    """The hook: `(groups, newest loaded version) -> groups`, some tampered."""

    def __init__(self, kind: str, seed: str):
        self.kind = kind
        self.rng = random.Random(seed)

    def __call__(self, groups: list[RolloutGroup], newest: int) -> list[RolloutGroup]:
        out = []
        for group in groups:
            if self.rng.random() < TAMPERED_SHARE:
                if self.kind in JUNK:
                    group = junk(group, self.kind, newest)
                else:
                    kind = self.kind if self.kind in CHEATS else self.rng.choice(CHEATS)
                    rollouts = [tamper(group.rollouts[0], kind, newest), *group.rollouts[1:]]
                    group = RolloutGroup(work_id=group.work_id, rollouts=rollouts)
            out.append(group)
        return out


def install(node, kind: str) -> None:
    """Make `node` (an InferenceNode) a cheater of `kind`."""
    node.before_submit.append(Cheater(kind, node.key.peer_id))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m node.adversary", description=__doc__.splitlines()[0])
    p.add_argument("--cheat", required=True, choices=[*CHEATS, "mixed", *JUNK], help="how this node cheats")
    ours, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    if "join" not in rest or "inference" not in rest:
        p.error("the rest must be `join --role inference ...`")
    from node import cli

    return cli.main(rest, customize=lambda node: install(node, ours.cheat))


if __name__ == "__main__":
    sys.exit(main())
