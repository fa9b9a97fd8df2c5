"""Who may use the validator's resident model (`node.roles.resident_policy.ResidentPolicies`), and when.

Readers only read the weights: judging rounds whose claims are all of the version the model holds now, and a hold
preparing the next version's step (`ResidentPolicies.prepare`). Any number of them at once. A writer switches or
changes the weights: a round that needs another version, a hold reading a version in (`commit`), pruning. One at a
time, alone. A writer waiting stops new readers, so a hold's commit is never starved by a stream of rounds.

Why: a hold had the model for the whole of its 2-7 s on the 5.2B shape, and the rounds of the claims the trainer's
next batch needed waited behind it (session 22's H200 network: a round that asked 0.4 s after a hold began waited
4 s). Preparing beside the rounds leaves the writer's part to the reading-in alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class ModelTurns:
    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.readers = 0
        self.writing = False
        self.writers_waiting = 0
        self.readers_waiting = 0
        """Turns asked and not yet granted (every change of these and the above is notified on the condition)."""

    async def enter(self, may_read: Callable[[], bool]) -> bool:
        """Wait for a turn; a reader's (True) while `may_read()` holds when it is granted, else a writer's (False).
        `may_read` is asked again each time the turns move (a writer may have switched the weights meanwhile)."""
        async with self._cond:
            while True:
                if not may_read():
                    await self._take_writer()
                    return False
                if not self.writing and not self.writers_waiting:
                    self.readers += 1
                    return True
                self.readers_waiting += 1
                self._cond.notify_all()
                try:
                    await self._cond.wait()
                finally:
                    self.readers_waiting -= 1

    async def write(self) -> None:
        """Wait for a writer's turn."""
        async with self._cond:
            await self._take_writer()

    async def _take_writer(self) -> None:
        self.writers_waiting += 1
        self._cond.notify_all()
        try:
            await self._cond.wait_for(lambda: not self.writing and self.readers == 0)
        finally:
            self.writers_waiting -= 1
        self.writing = True

    async def downgrade(self) -> None:
        """A writer becomes a reader (readers waiting may join it)."""
        async with self._cond:
            assert self.writing
            self.writing, self.readers = False, self.readers + 1
            self._cond.notify_all()

    async def upgrade(self) -> None:
        """A reader becomes the writer once the other readers are done (no new reader enters meanwhile). Only one
        reader may ask at a time (the validator's holds run one at a time)."""
        async with self._cond:
            self.readers -= 1
            self._cond.notify_all()
            await self._take_writer()

    async def until(self, state: Callable[[], bool], timeout_s: float) -> None:
        """Return once `state()` holds, looked at each time the turns change (`TimeoutError` after `timeout_s`):
        for whoever watches them (the role's tests)."""
        async with self._cond:
            await asyncio.wait_for(self._cond.wait_for(state), timeout_s)

    async def leave(self, reader: bool) -> None:
        async with self._cond:
            if reader:
                self.readers -= 1
            else:
                self.writing = False
            self._cond.notify_all()
