"""`payload_changes`: the bytes one held payload differs from another by, shard by shard on threads, kept up to
`CHANGES_UP_TO` of the version and no further."""

import numpy as np

from shardcast.changes import CHANGES_UP_TO, payload_changes

SHARD = 4096


def _pair(n: int, changed: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, n, dtype=np.uint8)
    new = old.copy()
    at = rng.choice(n, changed, replace=False)
    new[at] ^= rng.integers(1, 256, changed, dtype=np.uint8)  # each chosen byte really changes
    return old, new


def test_the_changes_are_every_differing_byte_in_order_whatever_the_threads():
    old, new = _pair(10 * SHARD + 123, 300)  # a short last shard
    for threads in (1, 3):
        got = payload_changes(4, [], old, new, SHARD, threads)
        assert got is not None and got.parent == 4
        assert (got.positions == np.flatnonzero(new != old)).all() and (got.values == new[got.positions]).all()
        rebuilt = old.copy()
        rebuilt[got.positions] = got.values
        assert (rebuilt == new).all()


def test_no_changes_past_the_budget_and_none_for_another_length():
    n = 64 * SHARD
    budget = int(n * CHANGES_UP_TO)
    old, new = _pair(n, budget)
    assert len(payload_changes(1, [], old, new, SHARD, 2).positions) == budget  # at the limit: kept
    old, new = _pair(n, budget + 1)
    assert payload_changes(1, [], old, new, SHARD, 2) is None  # one byte past it: the consumer reads it whole
    assert payload_changes(1, [], old, new[:-1], SHARD, 2) is None
    same = payload_changes(1, [], old, old.copy(), SHARD, 2)
    assert same is not None and len(same.positions) == 0
