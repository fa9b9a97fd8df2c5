"""The coordinator's status page (`/`), its data (`/status.json`) and Prometheus `/metrics`.

Read-only views of the coordinator's durable state; nothing here changes it.
"""

from __future__ import annotations

import time

from aiohttp import web

from protocol.coordinator_service import CoordinatorService
from shardcast.server import expect_without_echo

PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>primerl-node run</title>
<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 10px;text-align:left}</style></head>
<body><h1>run <span id="run"></span></h1>
<p>policy version <b id="version">-</b>; accepted <b id="accepted">0</b>, rejected <b id="rejected">0</b>,
banned <b id="banned">0</b></p>
<h2>reward</h2><svg id="curve" width="600" height="200" style="border:1px solid #ccc"></svg>
<h2>members</h2><table id="members"><tr><th>node</th><th>role</th><th>state</th></tr></table>
<h2>versions</h2><table id="versions"><tr><th>version</th><th>manifest</th><th>announced</th></tr></table>
<script>
async function refresh(){
  const s = await (await fetch('status.json')).json();
  document.getElementById('run').textContent = s.run_id;
  document.getElementById('version').textContent = s.policy_version;
  for (const k of ['accepted','rejected','banned']) document.getElementById(k).textContent = s[k];
  const m = document.getElementById('members');
  m.innerHTML = '<tr><th>node</th><th>role</th><th>state</th></tr>' + s.members.map(
    x => `<tr class="member"><td>${x.peer_id}</td><td>${x.role}</td><td>${x.state}</td></tr>`).join('');
  const v = document.getElementById('versions');
  v.innerHTML = '<tr><th>version</th><th>manifest</th><th>announced</th></tr>' + s.versions.map(
    x => `<tr class="version"><td>${x.version}</td><td>${x.manifest_hash.slice(0,16)}</td><td>${x.at}</td></tr>`).join('');
  const pts = s.reward_curve, svg = document.getElementById('curve');
  const n = Math.max(pts.length - 1, 1);
  const d = pts.map((p, i) => `${i ? 'L' : 'M'}${(i / n * 590 + 5).toFixed(1)},${(195 - p[1] * 190).toFixed(1)}`).join(' ');
  svg.innerHTML = `<path id="reward-path" d="${d}" fill="none" stroke="#1f77b4" stroke-width="2"/>` +
    `<text x="8" y="15" id="reward-points">${pts.length} steps</text>`;
}
refresh(); setInterval(refresh, 1000);
</script></body></html>"""


VERSIONS_SHOWN = 10
"""Newest policy versions listed (the page shows them all; older ones age out of the store too)."""


def status(service: CoordinatorService) -> dict:
    state, now = service.state, time.time()
    members = [{"peer_id": m.peer_id, "role": m.role, "state": state.view.state(m.peer_id, now)}
               for m in state.view.members.values()]
    return {
        "run_id": state.spec.run_id,
        "policy_version": state.ledger.current_version,
        "members": members,
        "versions": [{"version": v, "manifest_hash": h, "at": round(at, 2)}
                     for v, h, at in state.store.policy_versions(last=VERSIONS_SHOWN)],
        **state.store.totals(),
        "reward_curve": [[s, r] for s, r in state.store.reward_curve()],
    }


def metrics_text(service: CoordinatorService) -> str:
    s = status(service)
    alive = sum(m["state"] == "alive" for m in s["members"])
    lines = []
    for name, value, help_ in [
        ("primerl_policy_version", s["policy_version"], "newest announced policy version"),
        ("primerl_members_alive", alive, "members with recent heartbeats"),
        ("primerl_rollout_groups_accepted_total", s["accepted"], "work units accepted (stored)"),
        ("primerl_rollout_groups_rejected_total", s["rejected"], "work units failing verification"),
        ("primerl_rollout_groups_verified_total", s["verified"], "work units passing verification"),
        ("primerl_rollout_groups_batched_total", s["batched"], "work units trained on"),
        ("primerl_rollout_groups_stale_total", s["dropped_stale"], "work units dropped as too stale"),
        ("primerl_leases_outstanding", s["leased"], "work units leased now"),
        ("primerl_banned_peers", s["banned"], "banned peers"),
        ("primerl_reward_last", s["reward_curve"][-1][1] if s["reward_curve"] else 0.0, "mean reward of the last batch"),
    ]:
        kind = "counter" if name.endswith("_total") else "gauge"
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"


async def serve_status(service: CoordinatorService, port: int, host: str = "127.0.0.1") -> tuple[web.AppRunner, int]:
    async def page(_: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html")

    async def status_json(_: web.Request) -> web.Response:
        return web.json_response(status(service))

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=metrics_text(service), content_type="text/plain", charset="utf-8")

    app = web.Application()  # handlers are coroutines: aiohttp deprecates plain functions as handlers
    app.add_routes([web.get(path, handler, expect_handler=expect_without_echo)
                    for path, handler in [("/", page), ("/status.json", status_json), ("/metrics", metrics)]])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]
