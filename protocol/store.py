"""Durable coordinator state: SQLite (WAL) for the index, one file per accepted rollout.

Invariant: a rollout is acknowledged only after its file is fsynced and its index row is
committed; so after any crash (SIGKILL included) every acknowledged rollout has both. A file
without a row (crash between the two) was never acknowledged and is removed on open.
The rollout file holds the submitter's signed envelope bytes, so it stays attributable and can
be re-verified by anyone later.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

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
    path TEXT NOT NULL, accepted_at REAL NOT NULL, batch_step INTEGER, dropped TEXT);
CREATE TABLE IF NOT EXISTS bans (peer_id TEXT PRIMARY KEY, reason TEXT NOT NULL, until REAL, at REAL NOT NULL);
"""


@dataclass(frozen=True)
class AcceptedRollout:
    work_id: int
    submitter: str
    body_sha256: str
    min_version: int
    n_tokens: int
    reward: float
    path: Path
    accepted_at: float
    batch_step: int | None
    dropped: str | None


class CoordinatorStore:
    def __init__(self, directory: str | Path, synchronous: str = "FULL"):
        self.dir = Path(directory)
        self.rollout_dir = self.dir / "rollouts"
        self.rollout_dir.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.dir / "coordinator.sqlite3", isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit survives power loss too, not only a killed process (NORMAL would).
        self.db.execute(f"PRAGMA synchronous={synchronous}")
        self.db.executescript(_SCHEMA)
        self._remove_unacknowledged_files()

    # ---- transactions ----------------------------------------------------------------------
    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type, exc, tb) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")

    def q(self, sql: str, *args) -> list[tuple]:
        return self.db.execute(sql, args).fetchall()

    # ---- meta --------------------------------------------------------------------------------
    def get_meta(self, key: str, default: str | None = None) -> str | None:
        rows = self.q("SELECT value FROM meta WHERE key=?", key)
        return rows[0][0] if rows else default

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                        (key, value))

    # ---- rollouts ----------------------------------------------------------------------------
    def write_rollout_file(self, work_id: int, envelope: bytes) -> Path:
        """Write and fsync the signed envelope; the caller then commits the index row."""
        final = self.rollout_dir / f"{work_id:012d}.env"
        tmp = final.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, envelope)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        dfd = os.open(self.rollout_dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return final

    def insert_accepted(self, work_id: int, submitter: str, body_sha256: str, min_version: int, n_tokens: int,
                        reward: float, path: Path, now: float) -> None:
        self.db.execute("INSERT INTO accepted(work_id, submitter, body_sha256, min_version, n_tokens, reward, path, "
                        "accepted_at) VALUES(?,?,?,?,?,?,?,?)",
                        (work_id, submitter, body_sha256, min_version, n_tokens, reward, path.name, now))

    def accepted(self, work_id: int | None = None) -> list[AcceptedRollout]:
        sql = "SELECT * FROM accepted" + (" WHERE work_id=?" if work_id is not None else "") + " ORDER BY work_id"
        rows = self.q(sql, *(() if work_id is None else (work_id,)))
        return [AcceptedRollout(r[0], r[1], r[2], r[3], r[4], r[5], self.rollout_dir / r[6], r[7], r[8], r[9])
                for r in rows]

    def _remove_unacknowledged_files(self) -> None:
        known = {r[0] for r in self.q("SELECT path FROM accepted")}
        for f in self.rollout_dir.iterdir():
            if f.name not in known:
                f.unlink(missing_ok=True)

    def close(self) -> None:
        self.db.close()


def dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)
