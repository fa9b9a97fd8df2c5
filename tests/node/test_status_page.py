"""The coordinator's status page and /metrics while a real sim runs (every role its own process)."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.request

import pytest

from node.sim import run_sim

QUIET_S = 300.0
"""The snapshot's wait gives up after this long without a member joining or a step finishing (start-up
included: the trainer's warm-up takes tens of seconds on a loaded machine)."""


@pytest.fixture(scope="module")
def running_sim(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim")
    result: dict = {}
    # 30 steps keep the run live while the page is read; once both tests have read it, it is stopped.
    # This is no liveness test: a member may miss beats for a minute (at load ~30 on 2 cores the validator
    # missed 3 of 2 s during its start-up, was ejected and never re-joined, so the page never listed it)
    read = threading.Event()
    t = threading.Thread(target=lambda: result.update(run_sim(out, inference_nodes=1, steps=30, batch_groups=4,
                                                              group_size=4, run={"dead_after_missed": 30},
                                                              stop_when=lambda _: read.is_set())),
                         daemon=True)
    t.start()
    addr = out / "coordinator" / "addr"
    while t.is_alive() and not addr.exists():  # the sim gives up by itself if the coordinator never starts
        time.sleep(0.2)
    url = addr.read_text().splitlines()[1]
    # a snapshot once every role is a member and three steps are in: on a loaded machine that takes
    # a while, and once the run ends its members leave, so the page is read while the run is live.
    # The wait lasts while the page shows progress (members joining, steps), however slow.
    snapshot: dict = {}
    seen, moved = None, time.monotonic()
    while t.is_alive() and time.monotonic() - moved < QUIET_S:
        try:
            s = _get_json(url + "status.json")
        except OSError:  # not up yet, or too busy to answer: the run decides, by ending, that it is over
            time.sleep(0.5)
            continue
        roles = {m["role"] for m in s["members"]}
        if len(s["reward_curve"]) >= 3 and {"trainer", "validator", "relay", "inference"} <= roles:
            snapshot = {"status": s, "metrics": _get(url + "metrics")}
            break
        if (len(s["reward_curve"]), roles) != seen:
            seen, moved = (len(s["reward_curve"]), roles), time.monotonic()
        time.sleep(0.5)
    yield url, snapshot
    read.set()
    t.join()
    assert result.get("status") in ("stopped", "done"), result
    assert result["steps"] >= 3 and result["rollouts_lost"] == 0 and result["rollouts_duplicated"] == 0, result


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read().decode()


def _get_json(url: str) -> dict:
    return json.loads(_get(url))


@pytest.mark.slow  # a whole network of processes: runs after the fast tests
def test_status_json_and_prometheus_metrics_describe_the_run(running_sim):
    _, snapshot = running_sim
    assert snapshot, "the run never showed every role and three steps on its status page"
    s = snapshot["status"]
    roles = {m["role"] for m in s["members"]}
    assert {"trainer", "validator", "relay", "inference"} <= roles
    assert s["policy_version"] >= 2 and len(s["versions"]) >= 3
    assert len(s["reward_curve"]) >= 3 and all(0 <= r <= 1 for _, r in s["reward_curve"])
    metrics = snapshot["metrics"]
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if not line.startswith("#")}
    assert values["primerl_policy_version"] >= 2
    assert values["primerl_members_alive"] >= 4
    # every reported step but the newest had its full batch of 4 groups counted
    assert values["primerl_rollout_groups_batched_total"] >= 4 * (len(s["reward_curve"]) - 1)
    assert "# TYPE primerl_rollout_groups_accepted_total counter" in metrics


@pytest.mark.slow  # a whole network of processes: runs after the fast tests
def test_status_page_in_headless_chromium_shows_members_versions_and_reward_curve(running_sim):
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("chromium is not installed (CI installs it: apt-get install -y chromium)")
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=4000",
                          "--dump-dom", running_sim[0]], capture_output=True, text=True, timeout=60).stdout
    assert dom.count('class="member"') >= 4
    assert dom.count('class="version"') >= 3
    assert 'id="reward-path"' in dom and ' steps</text>' in dom
