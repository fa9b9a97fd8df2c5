"""A process's threads' CPU by family (node/thread_cpu.py): who held the cores while the engine's thread waited."""

import threading

import pytest

from benchmarks.gpu_network import phase_ms, thread_shares
from node.engine.phases import PhaseClock
from node.thread_cpu import ThreadClock, ThreadMonitor, family, merged

pytestmark = pytest.mark.skipif(not ThreadClock().available, reason="no /proc/self/task here")


def test_a_thread_family_is_its_name_without_the_counter():
    assert family("asyncio_3") == "asyncio" and family("ThreadPoolExecutor-2_5") == "ThreadPoolExecutor-2"
    assert family("engine") == "engine" and family("ring-12") == "ring" and family("MainThread") == "MainThread"


def test_a_lap_gives_the_busy_thread_its_cpu_and_the_sleeping_one_none():
    done, release = threading.Event(), threading.Event()

    def burn():
        total = 0
        for i in range(2_000_000):  # a fixed amount of work, whatever the machine's speed
            total += i * i
        done.set()
        release.wait(60)

    clock = ThreadClock()
    threads = [threading.Thread(target=burn, name="burner_0"),
               threading.Thread(target=release.wait, args=(60,), name="sleeper_0")]
    for t in threads:
        t.start()
    try:
        assert done.wait(60)
        lap = clock.lap()  # both threads still alive: an ended thread's seconds are not in a lap
    finally:
        release.set()
        for t in threads:
            t.join(60)
    burner, sleeper = lap["families"]["burner"], lap["families"]["sleeper"]
    assert burner["threads"] == 1 and burner["cpu_s"] > 0.005
    assert sleeper["threads"] == 1 and sleeper["cpu_s"] < burner["cpu_s"] / 4
    assert lap["wall_s"] > 0 and burner["runq_s"] >= 0
    again = clock.lap()  # counted from the last lap: the burner did nothing since
    assert "burner" not in again["families"] or again["families"]["burner"]["cpu_s"] < burner["cpu_s"] / 4


def test_the_monitor_hands_each_lap_once():
    monitor = ThreadMonitor(period_s=0.01)
    assert monitor.take() is None
    monitor.start()
    try:
        assert monitor.lapped.wait(30)
        lap = monitor.take()
    finally:
        monitor.stop()
    assert lap is not None and "thread-clock" in lap["families"] and "MainThread" in lap["families"]
    assert lap["wall_s"] > 0


def test_thread_shares_weigh_each_lap_by_its_rows_share_of_the_window():
    lap = lambda cpu, runq: {"wall_s": 1.0, "families": {"engine": {"cpu_s": cpu, "runq_s": runq, "threads": 1},  # noqa: E731
                                                          "MainThread": {"cpu_s": 0.2, "runq_s": 0.0, "threads": 1}}}
    rows = [(1.0, {"threads": lap(0.6, 0.1)}), (0.5, {"threads": lap(0.2, 0.3)}), (0.0, {"threads": lap(1.0, 1.0)}),
            (1.0, {"threads": None}), (1.0, {})]
    shares = thread_shares(rows)
    assert shares == {"engine": {"cpu": round(0.7 / 1.5, 3), "runq": round(0.25 / 1.5, 3)},
                      "MainThread": {"cpu": round(0.3 / 1.5, 3), "runq": 0.0}}
    assert list(shares) == ["engine", "MainThread"]  # by CPU, the largest first
    assert thread_shares([(1.0, {}), (1.0, {"threads": None})]) is None


def test_a_phase_clock_sums_wall_and_cpu_per_phase_until_taken():
    clock = PhaseClock()
    done = threading.Event()
    threading.Thread(target=done.set).start()
    with clock("wait"):
        assert done.wait(30)  # sleeps on an event: wall, little CPU
    for _ in range(3):
        with clock("work"):
            sum(i * i for i in range(200_000))  # a fixed amount of CPU work
    got = clock.take()
    assert got["work"][2] == 3 and got["wait"][2] == 1
    assert got["work"][1] > 0 and got["work"][0] >= got["work"][1] * 0.9
    assert clock.take() == {}  # taken: counted again from zero


def test_phase_ms_weighs_rows_by_their_share_and_divides_by_the_steps():
    rows = [(1.0, {"phases": {"decode": [0.02, 0.01, 4], "prefill": [0.004, 0.004, 1]}}),
            (0.5, {"phases": {"decode": [0.04, 0.02, 8]}}), (1.0, {"phases": None}), (1.0, {})]
    got = phase_ms(rows, 8)  # 4 + 0.5 x 8 steps
    assert got == {"decode": {"wall": 5.0, "cpu": 2.5}, "prefill": {"wall": 0.5, "cpu": 0.5}}
    assert phase_ms([(1.0, {})], 3) is None and phase_ms(rows, 0) is None


def test_laps_add_up_until_taken():
    a = {"wall_s": 0.25, "families": {"engine": {"cpu_s": 0.1, "runq_s": 0.01, "threads": 1}}}
    b = {"wall_s": 0.25, "families": {"engine": {"cpu_s": 0.2, "runq_s": 0.0, "threads": 1},
                                      "prove": {"cpu_s": 0.05, "runq_s": 0.0, "threads": 4}}}
    assert merged(None, a) == a
    assert merged(a, b) == {"wall_s": 0.5, "families": {"engine": {"cpu_s": 0.3, "runq_s": 0.01, "threads": 1},
                                                       "prove": {"cpu_s": 0.05, "runq_s": 0.0, "threads": 4}}}
