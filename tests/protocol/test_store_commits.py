"""The coordinator store reports commits held up by the disk (a slow fsync stalls every lease and
submission): counted over an interval, one warning per interval, nothing for fast commits."""

import logging

from protocol.store import SLOW_COMMIT_S, SLOW_REPORT_S, CoordinatorStore


def test_slow_commits_are_reported_once_an_interval_and_fast_ones_never(tmp_path, caplog):
    store = CoordinatorStore(tmp_path)
    caplog.set_level(logging.WARNING, logger="protocol.store")
    with store:  # a real commit: fast here, nothing to report
        pass
    store._timed_commit(SLOW_COMMIT_S / 2)
    assert not caplog.records
    store._timed_commit(SLOW_COMMIT_S * 3)
    store._timed_commit(SLOW_COMMIT_S * 5)
    assert not caplog.records, "reported at most once an interval"
    store._slow[2] -= SLOW_REPORT_S  # the interval has passed
    store._timed_commit(0.0)
    assert len(caplog.records) == 1
    assert "2 commits" in caplog.records[0].message and f"{SLOW_COMMIT_S * 5:.2f} s" in caplog.records[0].message
    store._timed_commit(0.0)
    store._slow[2] -= SLOW_REPORT_S
    store._timed_commit(0.0)
    assert len(caplog.records) == 1, "an interval without a slow commit says nothing"
