"""A trainer poll reads only the units that can still enter a batch (issue 17: `assign_batch` read
every accepted row and every verdict on each poll), and picks what the full scan picked."""

from __future__ import annotations

import sqlite3

from benchmarks.assign_batch import assign_batch_full_scan, build
from protocol import pipeline
from protocol.coordinator import Coordinator


def _plan(c: Coordinator, method: str) -> str:
    """The query plan of the SQL a store method runs (captured from SQLite's trace)."""
    seen: list[str] = []
    c.store.db.set_trace_callback(seen.append)
    getattr(c.store, method)(*((0,) if method in ("batch_of", "waiting_count") else ()))
    c.store.db.set_trace_callback(None)
    sql = next(s for s in seen if s.lstrip().upper().startswith("SELECT"))
    return " ".join(r[3] for r in c.store.db.execute("EXPLAIN QUERY PLAN " + sql).fetchall())


def test_a_poll_reads_waiting_units_through_an_index_and_picks_what_the_full_scan_picked(tmp_path):
    spec, step = build(tmp_path / "s", total=3000, waiting=200)
    c = Coordinator(tmp_path / "s", spec, synchronous="OFF", retain_versions=10**9)
    waiting = c.store.waiting()
    assert len(waiting) == 200 and all(r.batch_step is None and r.dropped is None for r, _ in waiting)
    assert [r.work_id for r, _ in waiting] == list(range(2800, 3000))
    verdicts = c.store.verdicts()
    assert all(v == verdicts.get(r.work_id) for r, v in waiting)  # the verdict rides along (None: none yet)
    for method, index in (("waiting", "accepted_waiting"), ("batch_of", "accepted_batch"),
                          ("waiting_count", "accepted_waiting"), ("unjudged", "accepted_waiting"),
                          ("pending_opinions", "accepted_waiting")):
        plan = _plan(c, method)
        assert index in plan and "SCAN accepted" not in plan.replace(f"USING INDEX {index}", ""), (method, plan)
    c.close()
    picked = {}
    for name, fn in (("indexed", pipeline.assign_batch), ("full_scan", assign_batch_full_scan)):
        copy = tmp_path / name
        copy.mkdir()
        for f in (tmp_path / "s").iterdir():
            if f.is_file():
                (copy / f.name).write_bytes(f.read_bytes())
        (copy / "rollouts").mkdir()
        c = Coordinator(copy, spec, synchronous="OFF", retain_versions=10**9)
        first = fn(c, step, 64, lambda w: w % 2 == 0)
        again = fn(c, step, 64, lambda w: w % 2 == 0)  # asking again for the step returns the same units
        picked[name] = (first, again, {r.work_id: r.dropped for r in c.store.accepted() if r.dropped})
        c.close()
    assert picked["indexed"] == picked["full_scan"]
    assert len(picked["indexed"][0]) == 64 and picked["indexed"][0] == picked["indexed"][1]
    assert set(picked["indexed"][2].values()) == {"stale", "banned"}


def test_state_from_before_the_indexes_gains_them_on_open(tmp_path):
    spec, step = build(tmp_path, total=300, waiting=100)
    db = sqlite3.connect(tmp_path / "coordinator.sqlite3")
    db.execute("DROP INDEX accepted_waiting")
    db.execute("DROP INDEX accepted_batch")
    db.commit()
    db.close()
    c = Coordinator(tmp_path, spec, synchronous="OFF", retain_versions=10**9)
    names = {r[0] for r in c.store.db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"accepted_waiting", "accepted_batch"} <= names
    assert len(pipeline.assign_batch(c, step, 16, lambda w: False)) == 16
    c.close()
