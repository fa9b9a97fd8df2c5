"""Per-version file locks, so several processes of one host can share one store.

A version's lock is `<root>/<run_id>/.locks/<version:08d>.lock`, an `flock` on a file that is never
deleted: a lock file inside the version's directory could be unlinked by retention while another
process waits on it, and two processes would then each hold "the" lock on two different inodes.
Writers (a fetch that downloads or decodes the version, a publish) hold it exclusively; a reader
holds it shared only while it opens the payload (a mapping, once made, outlives an unlink);
retention takes it without waiting and leaves a version alone while anyone holds it. `flock` locks
belong to an open file, so two threads of one process exclude each other too, and a killed holder's
lock is released by the kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

POLL_S = 0.02
"""How often a waiting fetch tries the lock again (it must stay cancellable, so it never blocks in flock)."""
PATIENCE_S = 120.0
"""How long a fetch waits for another process's lock before it goes on without it: a holder that is
stopped (SIGSTOP, a debugger) must not stall every role of the host. Safe, because every write is a
temporary name and an atomic rename; only the download is no longer shared."""


def lock_path(root: Path, run_id: str, version: int) -> Path:
    return root / run_id / ".locks" / f"{version:08d}.lock"


def _open(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


@contextlib.contextmanager
def held(path: Path, exclusive: bool = True) -> Iterator[None]:
    """Hold the lock, waiting for it (for threads: publish runs in one)."""
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextlib.asynccontextmanager
async def held_async(path: Path, exclusive: bool = True, patience_s: float | None = None) -> AsyncIterator[None]:
    """Hold the lock, polling for it without blocking the event loop (a cancel while waiting is clean);
    after `patience_s` (default `PATIENCE_S`) go on without it, logged."""
    fd = _open(path)
    give_up = time.monotonic() + (PATIENCE_S if patience_s is None else patience_s)
    try:
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > give_up:
                    log.warning("%s: held by another process for over %.0f s; going on without it", path,
                                PATIENCE_S if patience_s is None else patience_s)
                    break
                await asyncio.sleep(POLL_S)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def try_exclusive(path: Path) -> Iterator[bool]:
    """Take the lock if nobody holds it; yields whether it was taken (retention skips a busy version)."""
    fd = _open(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
