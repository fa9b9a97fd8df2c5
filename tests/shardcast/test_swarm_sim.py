"""The swarm simulator runs shardcast's own fetch policy over modelled links: small swarms finish,
the super-seeding origin sends about one copy, churn is survived, and a link-bound case takes
the time the link says."""

from __future__ import annotations

import math

from benchmarks import swarm_sim
from benchmarks.swarm_model import Host
from shardcast import sources


def _run(n=40, relays=1, churn=0.0, seed_copies=1):
    return swarm_sim.simulate(n, relays, 64e6, 4 * 2**20, 0.78, origin_bps=100e6 / 8 * 8, relay_bps=1e9, peers=6, churn=churn,
                              churn_window_s=5.0, seed=3, cpu_bps=1e9, relay_slots=32, seed_copies=seed_copies)


def test_small_swarm_finishes_with_the_origin_sending_about_one_copy(monkeypatch):
    calls = {"next": 0}
    real_next = sources.ShardSchedule.next

    def counting(self):
        calls["next"] += 1
        return real_next(self)

    monkeypatch.setattr(sources.ShardSchedule, "next", counting)
    r = _run()
    assert r["unfinished"] == 0 and r["failed"] == 0 and len(r["latencies"]) == 40
    assert calls["next"] >= 40 * r["shards"]  # every shard of every node was chosen by the real policy
    assert r["origin_bytes_over_version"] < 1.5
    assert r["peer_bytes_over_version"] > 5  # nodes served each other


def test_without_super_seeding_the_origin_sends_many_copies():
    assert _run(relays=0, seed_copies=0)["origin_bytes_over_version"] > 3 * _run(relays=0)["origin_bytes_over_version"]


def test_nodes_that_stay_finish_despite_churn():
    r = _run(n=60, relays=0, churn=0.2)
    assert r["left"] > 0
    assert r["unfinished"] == 0 and r["failed"] == 0 and len(r["latencies"]) == 60 - r["left"]


def test_one_client_behind_a_thin_uplink_takes_the_uplink_time():
    raw, up = 64 * 2**20, 8 * 2**20
    t = swarm_sim.loopback(1, raw, 4 * 2**20, up, cpu_bps=1e9, link_bps=1e12, seed_copies=0)["all_done_s"]
    assert math.isclose(t, raw * swarm_sim.FULL_WIRE_OVER_RAW / up, rel_tol=0.1), t


def test_residential_links_fall_in_the_issue_ranges():
    import random

    rng = random.Random(0)
    hosts: list[Host] = [swarm_sim.residential(rng, f"n{i}", 1e9) for i in range(500)]
    assert all(50 * swarm_sim.MBIT <= h.down <= 1000 * swarm_sim.MBIT and 10 * swarm_sim.MBIT <= h.up <= 100 * swarm_sim.MBIT
               and 0.020 <= h.rtt <= 0.200 for h in hosts)
