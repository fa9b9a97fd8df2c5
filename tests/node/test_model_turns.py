"""The validator's turns on its resident model (node/roles/model_turns.py): readers together, a writer alone, a
writer waiting stops new readers, and a turn asked as a reader becomes a writer's when the weights must switch."""

from __future__ import annotations

import asyncio

from node.roles.model_turns import ModelTurns


def test_readers_share_a_writer_waits_for_them_and_stops_new_readers():
    async def main():
        turns = ModelTurns()
        assert await turns.enter(lambda: True) and await turns.enter(lambda: True)
        assert turns.readers == 2
        writer = asyncio.ensure_future(turns.write())
        await turns.until(lambda: turns.writers_waiting == 1, 10)  # the writer waits
        late = asyncio.ensure_future(turns.enter(lambda: True))
        await turns.until(lambda: turns.readers_waiting == 1, 10)  # and a reader come after it waits behind it
        await turns.leave(reader=True)
        assert not writer.done() and not late.done(), "a reader still in, and the writer goes first"
        await turns.leave(reader=True)
        await asyncio.wait_for(writer, 10)
        assert turns.writing and not late.done()
        await turns.leave(reader=False)
        assert await asyncio.wait_for(late, 10) is True and turns.readers == 1

    asyncio.run(main())


def test_a_turn_that_must_switch_the_weights_is_a_writers_and_a_hold_goes_down_then_up():
    async def main():
        turns = ModelTurns()
        at_newest = False
        assert await turns.enter(lambda: at_newest) is False and turns.writing  # switches: alone
        reader = asyncio.ensure_future(turns.enter(lambda: True))
        await turns.until(lambda: turns.readers_waiting == 1, 10)
        assert not reader.done()
        at_newest = True
        await turns.downgrade()  # the hold made the newest active: rounds at it may join the preparation
        assert await asyncio.wait_for(reader, 10) is True and turns.readers == 2
        upgrading = asyncio.ensure_future(turns.upgrade())
        await turns.until(lambda: turns.writers_waiting == 1, 10)  # the hold waits for the round to finish
        assert not upgrading.done()
        await turns.leave(reader=True)
        await asyncio.wait_for(upgrading, 10)
        assert turns.writing and turns.readers == 0
        await turns.leave(reader=False)
        assert not turns.writing

    asyncio.run(main())
