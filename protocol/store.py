"""Durable coordinator state: the one module that holds the coordinator's SQL.

SQLite (WAL) for the index, append-only segment files for the rollouts (`protocol.segments`).
Everything else (the coordinator, the pipeline, the status page, `sim`'s audit) reads and writes
through the named methods here, never through SQL of its own.

Invariants:
- a rollout is acknowledged only after its bytes are fsynced in a segment and its index row
  (segment, offset, length) is committed and on disk; so after any crash (SIGKILL or power loss)
  every acknowledged rollout has both. Appends are grouped: one fsync and one commit for every
  submission that arrived meanwhile (fsync costs ~4 ms on the test disk);
- `defer_fsync` (the coordinator role's store): commits and appends only write, and `sync` (on another
  thread: the service's `SyncBarrier`) fsyncs the segment, then the WAL, before any reply that follows
  them goes out. A commit then never holds the event loop on the disk (session 18 saw commits of up to
  4.4 s while the trainer wrote a 10 GB policy version to the same disk, every lease and heartbeat
  waiting behind them). A power cut can leave an unacknowledged index row whose bytes the OS had not
  written; on open such a row is taken back (`_take_back_unsynced`: as if it never arrived, the work
  leased to its holder again);
- retention (`prune`): a work unit whose fate is final (trained on, or dropped) and whose policy
  version is more than the retained window behind leaves the index, its verdict and its work row go
  too, and a segment nothing points at any more is deleted. What the status page shows of it stays
  as totals (`meta`) and one reward row per trained step (`step_rewards`); a late submission for a
  pruned work id is still refused (`UnknownLease`: work ids are never minted twice).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from protocol.segments import Segments

log = logging.getLogger(__name__)

SLOW_COMMIT_S = 0.2
"""A commit slower than this (its fsync waiting behind other writes to the disk, e.g. a policy version's
payload file on the same host) is counted and reported, at most once per `SLOW_REPORT_S`: every lease
and submission waits on one."""
SLOW_REPORT_S = 10.0
CHECKPOINT_BYTES = 8 << 20
"""With `defer_fsync`, `checkpoint` (on the sync thread) moves the WAL into the database once it has grown past
this (SQLite's own automatic checkpoint, which would run inside a commit on the event loop, is off)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS members (
    peer_id TEXT PRIMARY KEY, role TEXT NOT NULL, addrs TEXT NOT NULL,
    joined_at REAL NOT NULL, last_seen REAL NOT NULL, last_seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS policy_versions (
    version INTEGER PRIMARY KEY, manifest_hash TEXT NOT NULL, announced_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS work (
    work_id INTEGER PRIMARY KEY, mint_version INTEGER NOT NULL, task_index INTEGER NOT NULL,
    seed TEXT NOT NULL, state TEXT NOT NULL, holder TEXT, lease_version INTEGER,
    deadline REAL, grants INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS work_state ON work(state, work_id);
CREATE TABLE IF NOT EXISTS accepted (
    work_id INTEGER PRIMARY KEY, submitter TEXT NOT NULL, body_sha256 TEXT NOT NULL,
    min_version INTEGER NOT NULL, n_tokens INTEGER NOT NULL, reward REAL NOT NULL,
    segment TEXT NOT NULL, offset INTEGER NOT NULL, length INTEGER NOT NULL,
    accepted_at REAL NOT NULL, batch_step INTEGER, dropped TEXT, probation INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS accepted_batch ON accepted(batch_step) WHERE batch_step IS NOT NULL;
CREATE INDEX IF NOT EXISTS accepted_waiting ON accepted(min_version) WHERE batch_step IS NULL AND dropped IS NULL;
CREATE TABLE IF NOT EXISTS verdicts (
    work_id INTEGER PRIMARY KEY, valid INTEGER NOT NULL, validator TEXT NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS bans (peer_id TEXT PRIMARY KEY, reason TEXT NOT NULL, until REAL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS strikes (peer_id TEXT PRIMARY KEY, count INTEGER NOT NULL, last_reason TEXT NOT NULL,
    valid_since INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS member_stamps (peer_id TEXT PRIMARY KEY, last_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS peer_record (peer_id TEXT PRIMARY KEY, credited INTEGER NOT NULL DEFAULT 0,
    expired INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS opinions (work_id INTEGER NOT NULL, validator TEXT NOT NULL, valid INTEGER NOT NULL,
    reason TEXT NOT NULL, severity TEXT NOT NULL, at REAL NOT NULL, PRIMARY KEY (work_id, validator));
CREATE TABLE IF NOT EXISTS judging (work_id INTEGER PRIMARY KEY, need INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS unseated (validator TEXT PRIMARY KEY, reason TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS step_rewards (step INTEGER PRIMARY KEY, groups INTEGER NOT NULL, reward_sum REAL NOT NULL);
"""
_PRUNED = ("accepted", "rejected", "verified", "batched", "dropped_stale")
"""Totals the status page shows, kept in meta as `pruned_<name>` for rows retention removed."""


@dataclass(frozen=True)
class AcceptedRollout:
    work_id: int
    submitter: str
    body_sha256: str
    min_version: int
    n_tokens: int
    reward: float
    segment: Path
    offset: int
    length: int
    accepted_at: float
    batch_step: int | None
    dropped: str | None
    probation: bool = False
    """Submitted while its submitter had no record (`Coordinator.probation_units`): it needs a
    valid verdict before it may enter a batch, whatever the verification selector says."""


@dataclass(frozen=True)
class Pruned:
    units: int
    """Work units removed from the index."""
    segments: list[str]
    """Segment files deleted."""


class CoordinatorStore:
    def __init__(self, directory: str | Path, synchronous: str = "FULL", defer_fsync: bool = False):
        self.dir = Path(directory)
        self._slow = [0, 0.0, time.monotonic()]  # slow commits since the last report: count, slowest, since
        self.deferred = defer_fsync and synchronous == "FULL"
        """Commits and appends do not fsync; `sync` does, for all of them so far (module docstring)."""
        self.segments = Segments(self.dir / "rollouts", fsync_each=not self.deferred)
        self._path = self.dir / "coordinator.sqlite3"
        self.db = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit survives power loss too, not only a killed process (NORMAL would). Deferred: NORMAL,
        # and `sync` fsyncs the WAL before a reply depends on it, which makes it FULL's durability.
        self.db.execute(f"PRAGMA synchronous={'NORMAL' if self.deferred else synchronous}")
        if self.deferred:
            self.db.execute("PRAGMA wal_autocheckpoint=0")
        self._checkpointer: sqlite3.Connection | None = None  # `sync`'s own connection (its thread's)
        self.db.executescript(_SCHEMA)
        if "probation" not in {r[1] for r in self._q("PRAGMA table_info(accepted)")}:  # state from before it
            self._x("ALTER TABLE accepted ADD COLUMN probation INTEGER NOT NULL DEFAULT 0")
        if "valid_since" not in {r[1] for r in self._q("PRAGMA table_info(strikes)")}:
            self._x("ALTER TABLE strikes ADD COLUMN valid_since INTEGER NOT NULL DEFAULT 0")
        # The replay guard's pairs live in their own file, committed without fsync (WAL, NORMAL): they
        # must survive the process (a SIGKILL), not a power cut, and are written every half second.
        self.guard_db = sqlite3.connect(self.dir / "replay_guard.sqlite3", isolation_level=None, check_same_thread=False)
        self.guard_db.execute("PRAGMA journal_mode=WAL")
        self.guard_db.execute("PRAGMA synchronous=NORMAL")
        self.guard_db.executescript("CREATE TABLE IF NOT EXISTS seen_nonces (key BLOB PRIMARY KEY, at REAL NOT NULL);"
                                    "CREATE INDEX IF NOT EXISTS seen_nonces_at ON seen_nonces(at);")
        self._take_back_unsynced()
        self.segments.cut_unacknowledged_tails(dict(self._q(
            "SELECT segment, MAX(offset + length) FROM accepted GROUP BY segment")))

    def _take_back_unsynced(self) -> None:
        """Index rows whose bytes are not (all) in their segment: committed but never synced before a power cut
        (`defer_fsync`), so never acknowledged. Each is taken back as if it had not arrived: its verdicts and
        opinions go, its work is leased to its holder again (a retry of the submission is accepted)."""
        sizes = self.segments.sizes()
        lost = [w for w, seg, end in self._q("SELECT work_id, segment, offset + length FROM accepted")
                if seg in sizes and end > sizes[seg]]  # a missing file is not a cut-short write: left as is
        if not lost:
            return
        log.warning("coordinator store: %d accepted rollouts whose bytes never reached the disk (a power cut before "
                    "their sync; none was acknowledged) taken back: work %s", len(lost), lost[:20])
        with self:
            for table in ("accepted", "verdicts", "opinions", "judging"):
                self.db.executemany(f"DELETE FROM {table} WHERE work_id=?", [(w,) for w in lost])
            self.db.executemany("UPDATE work SET state='leased' WHERE work_id=?", [(w,) for w in lost])

    # ---- durability (defer_fsync) ---------------------------------------------------------------
    @property
    def changes(self) -> int:
        """Rows changed by this store's connection so far: what a `sync` started now makes durable."""
        return self.db.total_changes

    def sync(self) -> None:
        """Make every commit so far durable (deferred mode; a no-op otherwise): the segment's bytes first, then
        the WAL, so an index row on disk never points past its bytes once synced. Called from one worker thread
        at a time (`SyncBarrier`), never the event loop's (`checkpoint` moves the WAL into the database)."""
        if not self.deferred:
            return
        t = time.perf_counter()
        self.segments.sync()
        wal = self._path.with_name(self._path.name + "-wal")
        try:
            fd = os.open(wal, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._timed_commit(time.perf_counter() - t)

    def checkpoint(self) -> None:
        """Deferred mode: move the WAL into the database once it has grown past `CHECKPOINT_BYTES` (PASSIVE: never
        waits on the loop's writes). On the same worker thread as `sync`, after it: no reply waits for this."""
        if not self.deferred:
            return
        try:
            size = os.stat(self._path.with_name(self._path.name + "-wal")).st_size
        except FileNotFoundError:
            return
        if size > CHECKPOINT_BYTES:
            if self._checkpointer is None:
                self._checkpointer = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
                self._checkpointer.execute("PRAGMA synchronous=NORMAL")
            self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")

    # ---- transactions ----------------------------------------------------------------------
    def __enter__(self) -> "CoordinatorStore":
        self.db.execute("BEGIN IMMEDIATE")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        t = time.perf_counter()
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        if not self.deferred:  # deferred: a commit does not wait on the disk; `sync` is timed instead
            self._timed_commit(time.perf_counter() - t)

    def _timed_commit(self, seconds: float) -> None:
        slow = self._slow
        if seconds > SLOW_COMMIT_S:
            slow[0], slow[1] = slow[0] + 1, max(slow[1], seconds)
        if slow[0] and time.monotonic() - slow[2] >= SLOW_REPORT_S:
            log.warning("coordinator store: %d commits over %.1f s in the last %.0f s (slowest %.2f s): the disk's "
                        "writes hold up its fsyncs%s", slow[0], SLOW_COMMIT_S, time.monotonic() - slow[2], slow[1],
                        " (synced off the event loop: the replies waited, nothing else did)" if self.deferred else "")
            slow[:] = [0, 0.0, time.monotonic()]

    def _q(self, sql: str, *args) -> list[tuple]:
        return self.db.execute(sql, args).fetchall()

    def _x(self, sql: str, *args) -> None:
        self.db.execute(sql, args)

    def _one(self, sql: str, *args):
        return self._q(sql, *args)[0][0]

    # ---- meta --------------------------------------------------------------------------------
    def get_meta(self, key: str, default: str | None = None) -> str | None:
        rows = self._q("SELECT value FROM meta WHERE key=?", key)
        return rows[0][0] if rows else default

    def set_meta(self, key: str, value: str) -> None:
        self._x("INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                key, value)

    # ---- members and bans --------------------------------------------------------------------
    def members(self) -> list[tuple[str, str, list[str], int]]:
        """(peer id, role, addresses, last heartbeat seq) of every member on record."""
        return [(p, r, json.loads(a), seq) for p, r, a, seq in
                self._q("SELECT peer_id, role, addrs, last_seq FROM members")]

    def put_member(self, peer_id: str, role: str, addrs: list[str], now: float) -> None:
        self._x("INSERT OR REPLACE INTO members VALUES(?,?,?,?,?,?)", peer_id, role, dumps(addrs), now, now, 0)

    def delete_member(self, peer_id: str) -> None:
        self._x("DELETE FROM members WHERE peer_id=?", peer_id)

    def put_ban(self, peer_id: str, reason: str, until: float | None, now: float) -> None:
        self._x("INSERT OR REPLACE INTO bans VALUES(?,?,?,?)", peer_id, reason, until, now)

    def ban_of(self, peer_id: str) -> tuple[str, float | None] | None:
        """(reason, until) of the peer's ban, if any (expired ones included)."""
        rows = self._q("SELECT reason, until FROM bans WHERE peer_id=?", peer_id)
        return rows[0] if rows else None

    def banned_peers(self) -> set[str]:
        return {r[0] for r in self._q("SELECT peer_id FROM bans")}

    def member_stamp(self, peer_id: str) -> int | None:
        """Envelope timestamp (ms) of the peer's last honoured Join or Leave."""
        rows = self._q("SELECT last_ms FROM member_stamps WHERE peer_id=?", peer_id)
        return rows[0][0] if rows else None

    def set_member_stamp(self, peer_id: str, stamp_ms: int) -> None:
        self._x("INSERT INTO member_stamps VALUES(?, ?) ON CONFLICT(peer_id) DO UPDATE SET last_ms=excluded.last_ms",
                peer_id, stamp_ms)

    # ---- the replay guard, persisted -----------------------------------------------------------
    def remember_seen(self, entries: list[tuple[bytes, float]], forget_before: float) -> None:
        """Add (signer + nonce, seen at) pairs and drop those older than `forget_before` (one transaction)."""
        g = self.guard_db
        g.execute("BEGIN IMMEDIATE")
        try:
            g.executemany("INSERT OR IGNORE INTO seen_nonces VALUES(?, ?)", entries)
            g.execute("DELETE FROM seen_nonces WHERE at < ?", (forget_before,))
        except BaseException:
            g.execute("ROLLBACK")
            raise
        g.execute("COMMIT")

    def seen_since(self, since: float) -> list[tuple[bytes, float]]:
        return [(bytes(k), at) for k, at in
                self.guard_db.execute("SELECT key, at FROM seen_nonces WHERE at >= ?", (since,)).fetchall()]

    # ---- policy versions ---------------------------------------------------------------------
    def add_policy_version(self, version: int, manifest_hash: str, now: float) -> None:
        self._x("INSERT INTO policy_versions VALUES(?,?,?)", version, manifest_hash, now)
        self.set_meta("policy_version", str(version))

    def policy_versions(self, last: int = 10) -> list[tuple[int, str, float]]:
        """(version, manifest hash, announced at) of the newest `last` versions, oldest first."""
        return self._q("SELECT * FROM (SELECT version, manifest_hash, announced_at FROM policy_versions "
                       "ORDER BY version DESC LIMIT ?) ORDER BY version", last)

    # ---- work and leases ---------------------------------------------------------------------
    def first_pending(self) -> tuple[int, int, int] | None:
        """(work id, task index, seed) of the oldest work unit back in the pool, if any."""
        row = self._q("SELECT work_id, task_index, seed FROM work WHERE state='pending' ORDER BY work_id LIMIT 1")
        return (row[0][0], row[0][1], int(row[0][2])) if row else None

    def mint_work(self, version: int, task: int, seed: int, holder: str, deadline: float,
                  lease_version: int | None = None) -> int:
        """A new work unit, leased to `holder`; work ids count up and are never reused. `lease_version`:
        the policy the holder rolls out with (default `version`, the one the work is minted at)."""
        work_id = int(self.get_meta("next_work_id", "0"))
        self.set_meta("next_work_id", str(work_id + 1))
        self._x("INSERT INTO work VALUES(?,?,?,?,'leased',?,?,?,1)", work_id, version, task, str(seed), holder,
                version if lease_version is None else lease_version, deadline)
        return work_id

    def next_work_id(self) -> int:
        return int(self.get_meta("next_work_id", "0"))

    def lease(self, work_id: int, holder: str, version: int, deadline: float) -> None:
        self._x("UPDATE work SET state='leased', holder=?, lease_version=?, deadline=?, grants=grants+1 "
                "WHERE work_id=?", holder, version, deadline, work_id)

    def lease_of(self, work_id: int) -> tuple[str, str | None, float | None] | None:
        """(state, holder, deadline) of a work unit, or None if it was never minted (or was pruned)."""
        rows = self._q("SELECT state, holder, deadline FROM work WHERE work_id=?", work_id)
        return rows[0] if rows else None

    def work_seed(self, work_id: int) -> tuple[int, int]:
        """(task index, seed) of a work unit."""
        task, seed = self._q("SELECT task_index, seed FROM work WHERE work_id=?", work_id)[0]
        return task, int(seed)

    def leases(self) -> list[tuple[int, int]]:
        """(work id, version it was leased at) of every lease out."""
        return self._q("SELECT work_id, lease_version FROM work WHERE state='leased'")

    def leased_count(self, holder: str | None = None) -> int:
        if holder is None:
            return self._one("SELECT COUNT(*) FROM work WHERE state='leased'")
        return self._one("SELECT COUNT(*) FROM work WHERE state='leased' AND holder=?", holder)

    def release(self, work_ids: list[int]) -> None:
        """Back to the pool (granted again with the same task and seed)."""
        self.db.executemany("UPDATE work SET state='pending', holder=NULL WHERE work_id=?", [(w,) for w in work_ids])

    def release_leases_of(self, peer_id: str) -> list[int]:
        ids = [r[0] for r in self._q("SELECT work_id FROM work WHERE state='leased' AND holder=?", peer_id)]
        self.release(ids)
        return ids

    def release_expired(self, now: float) -> list[int]:
        """Leases past their deadline back to the pool; each counts against its holder's record."""
        rows = self._q("SELECT work_id, holder FROM work WHERE state='leased' AND deadline<?", now)
        self.release([r[0] for r in rows])
        for holder in {r[1] for r in rows if r[1]}:
            n = sum(r[1] == holder for r in rows)
            self._x("INSERT INTO peer_record(peer_id, expired) VALUES(?, ?) ON CONFLICT(peer_id) DO UPDATE "
                    "SET expired=expired+excluded.expired", holder, n)
        return [r[0] for r in rows]

    # ---- what an identity has earned (lease allowance, protocol.pipeline.LeasePolicy) -------------
    def record_of(self, peer_id: str) -> tuple[int, int]:
        """(work units of the peer that entered a batch, leases it let expire)."""
        rows = self._q("SELECT credited, expired FROM peer_record WHERE peer_id=?", peer_id)
        return (rows[0][0], rows[0][1]) if rows else (0, 0)

    def credit(self, peer_id: str) -> None:
        self._x("INSERT INTO peer_record(peer_id, credited) VALUES(?, 1) ON CONFLICT(peer_id) DO UPDATE "
                "SET credited=credited+1", peer_id)

    def leased_by_newcomers(self) -> int:
        """Leases out to peers none of whose work has entered a batch yet."""
        return self._one("SELECT COUNT(*) FROM work w LEFT JOIN peer_record r ON r.peer_id = w.holder "
                         "WHERE w.state='leased' AND COALESCE(r.credited, 0) = 0")

    # ---- accepted rollouts -------------------------------------------------------------------
    def append_rollouts(self, envelopes: list[bytes]) -> list[tuple[str, int, int]]:
        """Append and fsync; (segment, offset, length) per envelope for `insert_accepted`, which the
        caller commits next (only then are they acknowledged)."""
        return self.segments.append(envelopes)

    def insert_accepted(self, work_id: int, submitter: str, body_sha256: str, min_version: int, n_tokens: int,
                        reward: float, where: tuple[str, int, int], now: float, probation: bool = False) -> None:
        self._x("INSERT INTO accepted(work_id, submitter, body_sha256, min_version, n_tokens, reward, segment, "
                "offset, length, accepted_at, probation) VALUES(?,?,?,?,?,?,?,?,?,?,?)",
                work_id, submitter, body_sha256, min_version, n_tokens, reward, *where, now, int(probation))
        self._x("UPDATE work SET state='accepted' WHERE work_id=?", work_id)

    def read_rollout(self, record: AcceptedRollout) -> bytes:
        return self.segments.read(record.segment.name, record.offset, record.length)

    def accepted(self, work_id: int | None = None) -> list[AcceptedRollout]:
        sql = "SELECT * FROM accepted" + (" WHERE work_id=?" if work_id is not None else "") + " ORDER BY work_id"
        rows = self._q(sql, *(() if work_id is None else (work_id,)))
        return [AcceptedRollout(r[0], r[1], r[2], r[3], r[4], r[5], self.segments.dir / r[6], *r[7:12], bool(r[12]))
                for r in rows]

    def waiting_count(self, min_version: int) -> int:
        """Accepted units not yet batched nor dropped, of policy version >= `min_version`."""
        return self._one("SELECT COUNT(*) FROM accepted INDEXED BY accepted_waiting WHERE batch_step IS NULL "
                         "AND dropped IS NULL AND min_version >= ?", min_version)

    def waiting(self) -> list[tuple[AcceptedRollout, bool | None]]:
        """Accepted units not yet batched nor dropped, oldest first, each with its verdict (None: none
        yet). Read through the partial index `accepted_waiting`: the cost follows the units waiting (a
        few batches' worth), not every unit the run ever accepted."""
        rows = self._q("SELECT a.*, v.valid FROM accepted a INDEXED BY accepted_waiting "
                       "LEFT JOIN verdicts v ON v.work_id = a.work_id "
                       "WHERE a.batch_step IS NULL AND a.dropped IS NULL ORDER BY a.work_id")
        return [(AcceptedRollout(r[0], r[1], r[2], r[3], r[4], r[5], self.segments.dir / r[6], *r[7:12], bool(r[12])),
                 None if r[13] is None else bool(r[13])) for r in rows]

    def unjudged(self, accepted_before: float | None = None) -> list[tuple[int, int, bool, float]]:
        """(work id, min version, on probation, accepted at) of accepted, unbatched, undropped units
        without a verdict (accepted before `accepted_before`, when given)."""
        before = () if accepted_before is None else (accepted_before,)
        return self._q("SELECT a.work_id, a.min_version, a.probation, a.accepted_at FROM accepted a "
                       "INDEXED BY accepted_waiting LEFT JOIN verdicts v ON v.work_id = a.work_id "
                       "WHERE v.work_id IS NULL AND a.dropped IS NULL AND a.batch_step IS NULL "
                       + ("AND a.accepted_at < ? " if before else "") + "ORDER BY a.work_id", *before)

    def judging_progress(self) -> tuple[float | None, float | None]:
        """(acceptance time of the newest unit with a verdict, time of the last verdict), None when none."""
        return tuple(self._q("SELECT MAX(a.accepted_at), MAX(v.at) FROM verdicts v JOIN accepted a "
                             "ON a.work_id = v.work_id")[0])

    def unbatch(self, work_ids: list[int], step: int, reason: str) -> list[int]:
        """Take units out of step `step`'s batch and drop them (`reason`); returns those that were in it."""
        inside = [w for w in work_ids if w in set(self.batch_of(step))]
        self.db.executemany("UPDATE accepted SET batch_step=NULL, dropped=? WHERE work_id=? AND batch_step=?",
                            [(reason, w, step) for w in inside])
        return inside

    def drop(self, work_ids: list[int], reason: str) -> None:
        """Mark units that will never enter a batch (`stale`, `banned`, `invalid`); batched ones keep their batch."""
        self.db.executemany("UPDATE accepted SET dropped=? WHERE work_id=? AND batch_step IS NULL",
                            [(reason, w) for w in work_ids])

    def put_verdict(self, work_id: int, valid: bool, validator: str, reason: str, now: float) -> bool:
        """Record the unit's verdict; False (and nothing changes) when it already has one."""
        before = self.db.total_changes
        self._x("INSERT OR IGNORE INTO verdicts VALUES(?,?,?,?,?)", work_id, int(valid), validator, reason, now)
        return self.db.total_changes > before

    def verdict_of(self, work_id: int) -> tuple[bool, str, str] | None:
        """(valid, validator, reason) of the unit's recorded verdict, if any."""
        rows = self._q("SELECT valid, validator, reason FROM verdicts WHERE work_id=?", work_id)
        return (bool(rows[0][0]), rows[0][1], rows[0][2]) if rows else None

    def forgive(self, peer_id: str, every: int) -> None:
        """Count one valid verdict of `peer_id`; each `every` of them since its last strike take one strike away."""
        self._x("UPDATE strikes SET valid_since = valid_since + 1 WHERE peer_id=?", peer_id)
        self._x("UPDATE strikes SET count = MAX(0, count - 1), valid_since = 0 WHERE peer_id=? AND valid_since >= ?",
                peer_id, every)

    def strikes_of(self, peer_id: str) -> int:
        rows = self._q("SELECT count FROM strikes WHERE peer_id=?", peer_id)
        return rows[0][0] if rows else 0

    def add_strike(self, peer_id: str, reason: str) -> int:
        """Count a borderline failure against `peer_id`; returns its strikes so far."""
        self._x("INSERT INTO strikes(peer_id, count, last_reason) VALUES(?, 1, ?) ON CONFLICT(peer_id) DO UPDATE "
                "SET count=count+1, last_reason=excluded.last_reason, valid_since=0", peer_id, reason)
        return self._one("SELECT count FROM strikes WHERE peer_id=?", peer_id)

    # ---- validators' opinions, spot checks, seats (protocol.judging) ------------------------------
    def opinions_of(self, work_id: int) -> list[tuple[str, bool, str, str]]:
        """(validator, valid, reason, severity) of every opinion counted on the unit, oldest first."""
        return [(v, bool(ok), r, sev) for v, ok, r, sev in self._q(
            "SELECT validator, valid, reason, severity FROM opinions WHERE work_id=? ORDER BY at, rowid", work_id)]

    def add_opinion(self, work_id: int, validator: str, valid: bool, reason: str, severity: str, now: float) -> None:
        self._x("INSERT OR IGNORE INTO opinions VALUES(?,?,?,?,?,?)", work_id, validator, int(valid), reason, severity,
                now)

    def pending_opinions(self) -> dict[int, tuple[set[str], int]]:
        """Unit -> (validators that gave an opinion, opinions it needs) for waiting units (accepted, not
        batched nor dropped) without a verdict yet; read through `accepted_waiting`, so a validator's
        poll costs what is waiting, not every opinion of the run (100k opinions: ~20 ms a poll before)."""
        out: dict[int, tuple[set[str], int]] = {}
        for w, v, need in self._q("SELECT o.work_id, o.validator, COALESCE(j.need, 1) FROM accepted a "
                                  "INDEXED BY accepted_waiting JOIN opinions o ON o.work_id = a.work_id "
                                  "LEFT JOIN judging j ON j.work_id = o.work_id "
                                  "LEFT JOIN verdicts vd ON vd.work_id = a.work_id "
                                  "WHERE a.batch_step IS NULL AND a.dropped IS NULL AND vd.work_id IS NULL"):
            out.setdefault(w, (set(), need))[0].add(v)
        return out

    def need_of(self, work_id: int) -> int:
        rows = self._q("SELECT need FROM judging WHERE work_id=?", work_id)
        return rows[0][0] if rows else 1

    def set_need(self, work_id: int, need: int) -> None:
        self._x("INSERT INTO judging VALUES(?, ?) ON CONFLICT(work_id) DO UPDATE SET need=excluded.need", work_id, need)

    def unseat(self, validator: str, reason: str, now: float) -> tuple[list[int], list[int]]:
        """The validator's opinions stop counting: those on units without a verdict go, and so do the
        passing verdicts it gave alone on units not yet batched (they are judged again). Returns
        (units whose verdict was withdrawn, undecided units that lost its opinion)."""
        self._x("INSERT OR IGNORE INTO unseated VALUES(?,?,?)", validator, reason, now)
        alone = [r[0] for r in self._q(
            "SELECT v.work_id FROM verdicts v JOIN accepted a ON a.work_id = v.work_id "
            "LEFT JOIN judging j ON j.work_id = v.work_id WHERE v.validator=? AND v.valid=1 "
            "AND COALESCE(j.need, 1) = 1 AND a.batch_step IS NULL AND a.dropped IS NULL", validator)]
        self.db.executemany("DELETE FROM verdicts WHERE work_id=?", [(w,) for w in alone])
        self.db.executemany("DELETE FROM opinions WHERE work_id=?", [(w,) for w in alone])
        self.db.executemany("DELETE FROM judging WHERE work_id=?", [(w,) for w in alone])
        undecided = [r[0] for r in self._q("SELECT work_id FROM opinions WHERE validator=? AND work_id NOT IN "
                                           "(SELECT work_id FROM verdicts)", validator)]
        self._x("DELETE FROM opinions WHERE validator=? AND work_id NOT IN (SELECT work_id FROM verdicts)", validator)
        return alone, undecided

    def unseated(self) -> dict[str, str]:
        """Validator -> why it lost its seat."""
        return dict(self._q("SELECT validator, reason FROM unseated"))

    def verdicts(self) -> dict[int, bool]:
        return {r[0]: bool(r[1]) for r in self._q("SELECT work_id, valid FROM verdicts")}

    def out_by_version(self) -> tuple[dict[int, int], dict[int, int]]:
        """({lease version: leases out}, {min version: accepted units waiting for a batch}), for the
        lease budget (`protocol.pipeline.reachable_room`)."""
        leased = dict(self._q("SELECT lease_version, COUNT(*) FROM work WHERE state='leased' GROUP BY lease_version"))
        waiting = dict(self._q("SELECT min_version, COUNT(*) FROM accepted INDEXED BY accepted_waiting WHERE "
                               "batch_step IS NULL AND dropped IS NULL GROUP BY min_version"))
        return leased, waiting

    def batch_sizes(self, after_step: int) -> dict[int, int]:
        """Step -> units assigned to its batch, for steps after `after_step` (batches still open or in training)."""
        return dict(self._q("SELECT batch_step, COUNT(*) FROM accepted INDEXED BY accepted_batch WHERE batch_step > ? "
                            "GROUP BY batch_step", after_step))

    def verdict_times(self) -> dict[int, float]:
        """Work id -> when its verdict was recorded (benchmarks.step_time's timeline)."""
        return dict(self._q("SELECT work_id, at FROM verdicts"))

    def batch_of(self, step: int) -> list[int]:
        return [r[0] for r in self._q("SELECT work_id FROM accepted INDEXED BY accepted_batch WHERE batch_step=? "
                                      "ORDER BY work_id", step)]

    def assign(self, work_id: int, step: int) -> None:
        self._x("UPDATE accepted SET batch_step=? WHERE work_id=?", step, work_id)

    def batched_ids(self, after_step: int = -1) -> set[int]:
        return {r[0] for r in self._q("SELECT work_id FROM accepted WHERE batch_step > ?", after_step)}

    # ---- what the status page shows --------------------------------------------------------------
    def totals(self) -> dict[str, int]:
        """accepted, rejected, verified, batched, dropped_stale (retention's pruned rows included),
        banned, leased."""
        live = {
            "accepted": self._one("SELECT COUNT(*) FROM accepted"),
            "rejected": self._one("SELECT COUNT(*) FROM verdicts WHERE valid=0"),
            "verified": self._one("SELECT COUNT(*) FROM verdicts WHERE valid=1"),
            "batched": self._one("SELECT COUNT(*) FROM accepted WHERE batch_step IS NOT NULL"),
            "dropped_stale": self._one("SELECT COUNT(*) FROM accepted WHERE dropped='stale'"),
        }
        out = {k: v + int(self.get_meta(f"pruned_{k}", "0")) for k, v in live.items()}
        return out | {"banned": self._one("SELECT COUNT(*) FROM bans"), "leased": self.leased_count()}

    def reward_curve(self) -> list[tuple[int, float]]:
        """(trainer step, mean reward of its batch's units), every step trained, pruned ones included."""
        return self._q("SELECT step, SUM(s) / SUM(n) FROM (SELECT step, reward_sum AS s, groups AS n FROM step_rewards "
                       "UNION ALL SELECT batch_step, SUM(reward), COUNT(*) FROM accepted WHERE batch_step IS NOT NULL "
                       "GROUP BY batch_step) GROUP BY step ORDER BY step")

    # ---- retention ---------------------------------------------------------------------------
    def prune(self, before_version: int) -> Pruned:
        """Remove final units (batched or dropped) whose policy version is below `before_version`, keeping
        their totals and their steps' rewards; then delete segments nothing points at. One transaction."""
        with self:
            gone = [r[0] for r in self._q("SELECT work_id FROM accepted WHERE min_version < ? AND "
                                          "(batch_step IS NOT NULL OR dropped IS NOT NULL)", before_version)]
            if gone:
                self._x("CREATE TEMP TABLE IF NOT EXISTS gone (work_id INTEGER PRIMARY KEY)")
                self._x("DELETE FROM gone")
                self.db.executemany("INSERT INTO gone VALUES(?)", [(w,) for w in gone])
                counts = self._q(
                    "SELECT COUNT(*), SUM(batch_step IS NOT NULL), SUM(dropped='stale'), "
                    "(SELECT COUNT(*) FROM verdicts WHERE valid=0 AND work_id IN gone), "
                    "(SELECT COUNT(*) FROM verdicts WHERE valid=1 AND work_id IN gone) "
                    "FROM accepted WHERE work_id IN gone")[0]
                named = dict(zip(("accepted", "batched", "dropped_stale", "rejected", "verified"), counts))
                for name in _PRUNED:
                    self.set_meta(f"pruned_{name}", str(int(self.get_meta(f"pruned_{name}", "0")) + (named[name] or 0)))
                # a step whose units straddle the cut keeps its pruned part here, the rest stays live
                self._x("INSERT INTO step_rewards SELECT batch_step, COUNT(*), SUM(reward) FROM accepted "
                        "WHERE work_id IN gone AND batch_step IS NOT NULL GROUP BY batch_step "
                        "ON CONFLICT(step) DO UPDATE SET groups=groups+excluded.groups, "
                        "reward_sum=reward_sum+excluded.reward_sum")
                for table in ("accepted", "verdicts", "work", "opinions", "judging"):
                    self._x(f"DELETE FROM {table} WHERE work_id IN gone")
            self._x("DELETE FROM policy_versions WHERE version < ?", before_version)
        referenced = {r[0] for r in self._q("SELECT DISTINCT segment FROM accepted")}
        return Pruned(len(gone), self.segments.delete_unreferenced(referenced))

    def close(self) -> None:
        self.sync()
        self.segments.close()
        if self._checkpointer is not None:
            self._checkpointer.close()
        self.db.close()
        self.guard_db.close()


def dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)
