"""A role's stop event: set by the first SIGINT or SIGTERM, or by the coordinator (the run's end, a
ban). Torch-free: the coordinator uses it and starts without importing torch (seconds under load)."""

from __future__ import annotations

import asyncio
import signal
import sys


def stop_on_signals() -> asyncio.Event:
    """An event set by the first SIGINT or SIGTERM (a clean shutdown follows)."""
    from protocol.client import RunStop

    stop = RunStop()  # also ended by the coordinator: the run's end (exit 0) or a ban (EXIT_BANNED)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if hasattr(signal, "SIGUSR2"):  # `kill -USR2 PID`: every asyncio task's stack to stderr (a shutdown that hangs)
        loop.add_signal_handler(signal.SIGUSR2, dump_tasks)
    return stop


def dump_tasks() -> None:
    for task in asyncio.all_tasks():
        print(f"--- {task.get_name()}: {task.get_coro()!r}", file=sys.stderr, flush=True)
        task.print_stack(file=sys.stderr)
