"""One command starts an expert-parallel world: `join --role inference --ep N` run by hand (not under
torchrun) becomes rank 0 and starts ranks 1..N-1 itself, as copies of the same command, with a
rendezvous on 127.0.0.1 (torchrun's env:// variables: MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK).

Invariant: no rank outlives the node that started it. Rank 0 stops them with the engine's `stop`
order and then `Followers.close` waits for them (SIGKILL after a grace); a rank whose parent is gone
(rank 0 SIGKILLed) exits by itself (`watch_parent`), even where its collectives would wait on.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from node.distributed.ports import free_port

log = logging.getLogger(__name__)

PARENT_ENV = "PRIMERL_EP_PARENT"
"""Set in the ranks `spawn_followers` starts: the process id of rank 0 (their parent)."""
EXIT_PARENT_GONE = 3
"""Exit code of a rank that saw its rank 0 disappear."""


class Followers:
    """Ranks 1..N-1 started by rank 0."""

    def __init__(self, procs: dict[int, subprocess.Popen], logs: dict[int, Path]):
        self.procs, self.logs = procs, logs

    def exited(self) -> dict[int, int]:
        """Rank -> exit code, of the ranks that have exited."""
        return {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}

    def close(self, grace_s: float = 15.0) -> dict[int, int]:
        """Wait for every rank to exit (they leave on the engine's stop order); SIGKILL those still
        running after `grace_s`. Returns each rank's exit code."""
        end = time.monotonic() + grace_s
        for r, p in self.procs.items():
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("expert-parallel rank %d still running %.0fs after the stop: SIGKILL (log: %s)",
                            r, grace_s, self.logs[r])
                p.send_signal(signal.SIGKILL)
                p.wait(10)
        codes = {r: p.returncode for r, p in self.procs.items()}
        for r, code in codes.items():
            if code != 0:
                log.warning("expert-parallel rank %d exited with code %s (log: %s)", r, code, self.logs[r])
        return codes


_started: Followers | None = None


def started() -> Followers | None:
    """The ranks this process started (None: none, e.g. under torchrun)."""
    return _started


def spawn_followers(ep: int, argv: list[str], log_dir: Path) -> Followers:
    """Make this process rank 0 of a world of `ep` on 127.0.0.1 (sets its rendezvous variables in
    os.environ) and start ranks 1..ep-1 running `argv`, each logging to LOG_DIR/ep-rank-R.log."""
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(ep),
             "LOCAL_WORLD_SIZE": str(ep)}
    os.environ.update(world, RANK="0", LOCAL_RANK="0")
    log_dir.mkdir(parents=True, exist_ok=True)
    procs, logs = {}, {}
    for r in range(1, ep):
        logs[r] = log_dir / f"ep-rank-{r}.log"
        env = dict(os.environ, **world, RANK=str(r), LOCAL_RANK=str(r), **{PARENT_ENV: str(os.getpid())})
        # a session of its own: a Ctrl-C at the terminal reaches rank 0, which stops the world in order
        procs[r] = subprocess.Popen(argv, env=env, stdout=logs[r].open("a"), stderr=subprocess.STDOUT,
                                    start_new_session=True)
    log.info("expert-parallel world of %d: started ranks 1..%d (logs %s)", ep, ep - 1, log_dir / "ep-rank-*.log")
    global _started
    _started = Followers(procs, logs)
    return _started


def watch_parent(poll_s: float = 1.0) -> None:
    """In a rank `spawn_followers` started: exit (EXIT_PARENT_GONE) as soon as rank 0 is gone."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return  # started by torchrun, which stops its ranks itself

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(poll_s)
        log.error("rank 0 (pid %s) is gone: leaving", parent)
        os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=watch, name="watch-rank0", daemon=True).start()
