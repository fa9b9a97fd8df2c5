"""A version's changed bytes: where it differs from a version a consumer already holds (its parent), as payload
positions and new values, so that consumer writes a few MB instead of reading GB.

Invariant: `ChangedBytes` are kept only while at most `CHANGES_UP_TO` of the version's bytes differ; past that
there are none, and the consumer reads the version whole. They come from a delta decoded against its parent
(`shardcast.fetch`), or from two held payloads compared (`payload_changes`); either way both versions' bytes
were verified against their manifests' raw hashes first.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from shardcast.sparse import mask_scratch

CHANGES_UP_TO = 1 / 64
"""A delta's changed bytes are kept (`ChangedBytes`, 9 bytes each: position and value) while they are at most
this share of the version's: 0.49 GB of changes for a 31 GB version, 6x what one RL step changed of SmolLM2's
served form (0.25%); beyond it a whole copy costs about what the writes would."""


@dataclass
class ChangedBytes:
    """Where a version differs from its parent (found as its shards were decoded as a delta of it, or by comparing
    the two payloads): the payload positions of every byte that differs (sorted) and its new value. A consumer that
    holds exactly the parent's bytes, laid out as `tensors` say, holds this version once these bytes are written
    (node/engine/weight_staging.py `SparseWrites`): a few MB where the version is GB."""

    parent: int
    tensors: list
    positions: np.ndarray
    values: np.ndarray

    @classmethod
    def of(cls, parent: int, tensors: list, per_shard: dict[int, tuple[np.ndarray, np.ndarray]]) -> ChangedBytes:
        order = sorted(per_shard)
        pos = [per_shard[i][0] for i in order]
        val = [per_shard[i][1] for i in order]
        return cls(parent, tensors, np.concatenate(pos) if pos else np.empty(0, np.int64),
                   np.concatenate(val) if val else np.empty(0, np.uint8))


def shard_changes(start: int, out: np.ndarray, parent_raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The payload positions (from `start`, the shard's first byte) where `out` differs from `parent_raw`, and
    `out`'s bytes there. Compared into this thread's mask, kept between shards (a fresh 64 MiB one a shard is
    faulted in each time: 52-114 ms a shard at 1% changed against 44 ms, cpu-2core under load)."""
    mask = mask_scratch(len(out))
    np.not_equal(out, parent_raw, out=mask)
    at = np.flatnonzero(mask)
    return at + start, out[at]


class ChangeTally:
    """The changed bytes of a version's shards as threads find them, kept while their total stays within
    `CHANGES_UP_TO` of the version's `total_bytes`; past it, none (`over`, and `changes` gives None)."""

    def __init__(self, total_bytes: int):
        self._left = int(total_bytes * CHANGES_UP_TO)
        self._per_shard: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    @property
    def over(self) -> bool:
        """Whether more than the limit changed (a thread may skip what is left)."""
        return self._left < 0

    def compare(self, i: int, start: int, out: np.ndarray, parent_raw: np.ndarray) -> None:
        """Shard `i` (its first byte at payload offset `start`): `out`'s bytes against its parent's. Each shard once."""
        if self.over:
            return
        kept = shard_changes(start, out, parent_raw)
        with self._lock:
            self._left -= len(kept[0])
            if self.over:
                self._per_shard.clear()  # too many: the consumer copies the version whole
            else:
                self._per_shard[i] = kept

    def changes(self, parent: int, tensors: list) -> ChangedBytes | None:
        return None if self.over else ChangedBytes.of(parent, tensors, self._per_shard)


def payload_changes(parent: int, tensors: list, old: np.ndarray, new: np.ndarray, shard_size: int,
                    threads: int = 8) -> ChangedBytes | None:
    """`new`'s bytes against `old`'s (two verified payloads of one layout, `tensors`), as `ChangedBytes` of
    `parent` (the version `old` holds), compared a shard at a time on `threads` threads; None once more than
    `CHANGES_UP_TO` of the bytes differ (the threads stop at their next shard). For a version the store held
    already (a trainer on this host listed it, or a member fetched it earlier): a consumer holding `parent` then
    writes what changed instead of reading the version whole, as it would after decoding it as a delta here."""
    if len(old) != len(new):
        return None
    tally = ChangeTally(len(new))

    def one(i: int) -> None:
        a, b = i * shard_size, min((i + 1) * shard_size, len(new))
        if not tally.over:
            tally.compare(i, a, np.asarray(new[a:b]), np.asarray(old[a:b]))

    with ThreadPoolExecutor(max(1, threads)) as pool:
        list(pool.map(one, range(-(-len(new) // shard_size))))
    return tally.changes(parent, tensors)
