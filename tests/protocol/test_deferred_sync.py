"""The coordinator role's store defers its fsyncs (`CoordinatorStore(defer_fsync=True)`): a commit never holds the
event loop on the disk, every reply waits for one grouped fsync on a worker thread (`SyncBarrier`), and an
index row whose bytes a power cut kept off the disk (never acknowledged) is taken back on open."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from protocol.coordinator_service import SyncBarrier
from protocol.store import CoordinatorStore


def _accept(store: CoordinatorStore, work_ids: list[int], holder: str = "peer-a") -> None:
    """Work leased to `holder`, then its rollouts appended and indexed, as `Coordinator.submit_many` does."""
    with store as db:
        for w in work_ids:
            db.mint_work(0, w, w, holder, 1e12)
    where = store.append_rollouts([f"envelope {w}".encode() * 8 for w in work_ids])
    with store as db:
        for w, loc in zip(work_ids, where):
            db.insert_accepted(w, holder, f"{w:064x}", 0, 8, 1.0, loc, 0.0)


class GatedSync:
    """The store's real `sync`, held at a gate so the test sees what happens while an fsync is in flight."""

    def __init__(self, store: CoordinatorStore):
        self.real, self.calls, self.gate, self.entered = store.sync, 0, threading.Event(), threading.Event()
        store.sync = self

    def __call__(self) -> None:
        self.calls += 1
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        self.real()


def test_replies_wait_for_one_grouped_fsync_off_the_loop_which_keeps_running_meanwhile(tmp_path):
    store = CoordinatorStore(tmp_path, defer_fsync=True)
    assert store.deferred and store.db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL: commits only write
    gated = GatedSync(store)
    barrier = SyncBarrier(store)

    async def main() -> None:
        _accept(store, [0, 1])
        first = asyncio.ensure_future(barrier.wait())
        await asyncio.wait_for(asyncio.to_thread(gated.entered.wait, 30), 35)  # that fsync is now in flight
        _accept(store, [2, 3])  # committed while it runs: a later sync must cover these
        waiters = [asyncio.ensure_future(barrier.wait()) for _ in range(5)]

        async def read_meanwhile() -> int:  # what a heartbeat or a held request does: it runs while the disk is busy
            return len(store.accepted())
        assert await asyncio.wait_for(read_meanwhile(), 30) == 4
        assert not first.done() and not any(w.done() for w in waiters), "replies went out before their fsync"
        gated.gate.set()
        await asyncio.wait_for(asyncio.gather(first, *waiters), 30)
        assert gated.calls == 2, "the five replies that came during the first fsync shared the second"
        await barrier.wait()  # nothing new committed: no fsync at all
        assert gated.calls == 2

    asyncio.run(main())
    barrier.close()
    store.close()


def test_a_failed_fsync_fails_the_replies_waiting_on_it_and_the_next_one_tries_again(tmp_path):
    store = CoordinatorStore(tmp_path, defer_fsync=True)
    real, failures = store.sync, [OSError(5, "Input/output error")]

    def flaky() -> None:
        if failures:
            raise failures.pop()
        real()
    store.sync = flaky
    barrier = SyncBarrier(store)

    async def main() -> None:
        _accept(store, [0])
        with pytest.raises(OSError, match="Input/output"):
            await barrier.wait()
        await asyncio.wait_for(barrier.wait(), 30)  # the disk is back: this one syncs and passes

    asyncio.run(main())
    barrier.close()
    store.close()


def test_an_inline_store_needs_no_barrier_thread(tmp_path):
    store = CoordinatorStore(tmp_path)  # FULL, fsync in every commit (tests and tools use it directly)
    assert not store.deferred and store.db.execute("PRAGMA synchronous").fetchone()[0] == 2
    barrier = SyncBarrier(store)
    _accept(store, [0])
    asyncio.run(asyncio.wait_for(barrier.wait(), 5))
    store.close()


def test_rows_whose_bytes_a_power_cut_kept_off_the_disk_are_taken_back_and_the_rest_stay(tmp_path):
    store = CoordinatorStore(tmp_path, defer_fsync=True)
    _accept(store, [0, 1, 2])
    store.sync()
    _accept(store, [3, 4])  # committed; the power goes before their sync wrote their bytes (only the WAL's went)
    segment = store.segments.dir / store.segments.current
    cut = next(r for r in store.accepted() if r.work_id == 3).offset - 4  # the first unsynced record's start
    store.segments.close()
    store.db.close()
    store.guard_db.close()
    os.truncate(segment, cut + 3)  # part of work 3's length prefix made it, nothing after

    again = CoordinatorStore(tmp_path, defer_fsync=True)
    assert sorted(r.work_id for r in again.accepted()) == [0, 1, 2]
    assert [again.read_rollout(r) for r in again.accepted()] == [f"envelope {w}".encode() * 8 for w in (0, 1, 2)]
    assert segment.stat().st_size == cut, "the torn tail is cut back to the last indexed record"
    assert again.lease_of(3)[:2] == ("leased", "peer-a") and again.lease_of(4)[:2] == ("leased", "peer-a")
    assert again.leased_count("peer-a") == 2 and again.lease_of(2)[0] == "accepted"
    where = again.append_rollouts([b"retry of 3"])  # the holder's retry is stored as new
    with again as db:
        db.insert_accepted(3, "peer-a", "33" * 32, 0, 8, 1.0, where[0], 1.0)
    assert sorted(r.work_id for r in again.accepted()) == [0, 1, 2, 3]
    again.close()


def test_a_lease_is_answered_while_the_disk_is_busy_and_an_accepted_rollout_only_once_it_is_on_disk(tmp_path):
    from benchmarks.protocol import rollout
    from protocol.identity import NodeKey
    from protocol_testnet import client, eventually, lease_one, make_spec, run, start_coordinator, start_member, stop_all

    async def main() -> None:
        ck = NodeKey.generate()
        spec = make_spec(ck, heartbeat_interval_s=5.0)
        coord = await start_coordinator(tmp_path, ck, spec, policy_version=0)
        store = coord.state.store
        assert store.deferred
        member = await start_member(spec, coord.host.addrs[0])
        gated = GatedSync(store)
        try:
            grant = await lease_one(member)  # answered with the gate shut: a lease does not wait on the disk
            submitting = asyncio.ensure_future(client(member).submit(rollout(grant.work_id)))
            await eventually(lambda: bool(store.accepted(grant.work_id)) and gated.entered.is_set(),
                             what="the rollout committed and its fsync under way")
            assert not submitting.done(), "a receipt went out before the rollout was on disk"
            gated.gate.set()
            receipt = await asyncio.wait_for(submitting, 30)
            assert receipt.accepted and receipt.work_id == grant.work_id
        finally:
            gated.gate.set()
            await stop_all(coord, [member])

    run(main())


def test_a_validator_pulls_and_judges_while_the_disk_is_busy_and_a_batch_waits_for_it(tmp_path):
    """Session 22's one-host run: commits of 2.6-3.0 s behind the trainer's version writes held the validator's
    verify requests and verdicts, and so the trainer's next batch. They are answered from the written commit; the
    batch that holds the verdict goes out only once it is on disk."""
    from benchmarks.protocol import rollout
    from protocol.identity import NodeKey
    from protocol.messages import BatchRequest, StoredWorkBatch, Verdict, VerdictBatch, VerifyRequest
    from protocol_testnet import client, eventually, lease_one, make_spec, run, start_coordinator, start_member, stop_all

    async def main() -> None:
        ck, vk, tk = NodeKey.generate(), NodeKey.generate(), NodeKey.generate()
        spec = make_spec(ck, heartbeat_interval_s=5.0, validators=[vk.peer_id], trainer=tk.peer_id, batch_groups=1)
        coord = await start_coordinator(tmp_path, ck, spec, policy_version=0)
        store = coord.state.store
        node = await start_member(spec, coord.host.addrs[0])
        validator = await start_member(spec, coord.host.addrs[0], role="validator", key=vk)
        trainer = await start_member(spec, coord.host.addrs[0], role="trainer", key=tk)
        gated = GatedSync(store)
        try:
            grant = await lease_one(node)
            submitting = asyncio.ensure_future(client(node).submit(rollout(grant.work_id)))
            await eventually(lambda: bool(store.accepted(grant.work_id)) and gated.entered.is_set(),
                             what="the rollout committed and its fsync under way")
            # the gate stays shut: the validator is answered from what is written
            got = await asyncio.wait_for(validator.net.request(ck.peer_id, VerifyRequest(max_items=8)), 30)
            assert isinstance(got, StoredWorkBatch) and [i.work_id for i in got.items] == [grant.work_id]
            verdict = Verdict(work_id=grant.work_id, submitter=node.key.peer_id, valid=True)
            await asyncio.wait_for(validator.net.request(ck.peer_id, VerdictBatch(verdicts=[verdict])), 30)
            assert store.verdict_of(grant.work_id) is not None
            asking = asyncio.ensure_future(trainer.net.request(ck.peer_id, BatchRequest(step=1, groups=1)))
            await eventually(lambda: store.batch_of(1) == [grant.work_id], what="the batch assigned")
            assert not submitting.done() and not asking.done(), "a receipt or a batch went out before the disk"
            gated.gate.set()
            assert (await asyncio.wait_for(submitting, 30)).accepted
            batch = await asyncio.wait_for(asking, 30)
            assert [i.work_id for i in batch.items] == [grant.work_id]
        finally:
            gated.gate.set()
            await stop_all(coord, [node, validator, trainer])

    run(main())


def test_the_wal_is_checkpointed_on_the_sync_thread_after_the_replies(tmp_path, monkeypatch):
    import protocol.store

    monkeypatch.setattr(protocol.store, "CHECKPOINT_BYTES", 64 << 10)
    store = CoordinatorStore(tmp_path, defer_fsync=True)
    assert store.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0  # never inside a commit on the loop
    barrier = SyncBarrier(store)
    db_file = tmp_path / "coordinator.sqlite3"

    async def main() -> None:
        before = db_file.stat().st_size
        _accept(store, list(range(400)))  # well past 64 KiB of WAL
        await asyncio.wait_for(barrier.wait(), 30)
        # the checkpoint was queued on the sync thread after the replies: a job queued behind it ends after it
        await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(barrier._thread, lambda: None), 30)
        assert db_file.stat().st_size > before, "the WAL's pages never reached the database file"

    asyncio.run(main())
    barrier.close()
    assert len(store.accepted()) == 400
    store.close()
