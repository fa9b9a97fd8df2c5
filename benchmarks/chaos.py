"""`python -m benchmarks.chaos --minutes M`: the local network under random faults, with a seed.

The network of `primerl-node sim` (coordinator, trainer, validator, relay, N inference nodes, one
OS process each on 127.0.0.1, real libp2p and HTTP), except that every member's link to the
coordinator and every shardcast source runs through a fault-injecting TCP proxy of ours
(benchmarks/faultproxy.py), and the relay's shard store sits on its own small tmpfs. One fault at
a time, at random (seeded), with a random gap:

  kill       SIGKILL of any role (inference, validator, relay, trainer, coordinator), restart 1-5 s later
  pause      SIGSTOP of a role's process group for 3-10 s, then SIGCONT
  slow_link  100-300 ms one-way latency and 5% loss on a random group of links, 10-30 s
  partition  half of the inference nodes (and with them nothing else) cut from the coordinator and
             the shardcast sources, 5-20 s
  disk_full  the relay's tmpfs filled to the last byte for 10-30 s
  flood      200 junk TCP connections (random bytes, then held open) on every listening port, 5-15 s

A role that exits on its own is a crash: it is counted and restarted. Recovery time of a fault is
the time from its end (restart, resume, heal) to the next finished trainer step. At the end,
`rollouts_lost`, `rollouts_duplicated`, bans and cheaters come from the coordinator's store and the
trainer's per-step log (node/sim_report.py `summarize`), never assumed. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

from benchmarks.faultproxy import FaultProxy
from node.run_config import to_toml
from node.sim_procs import Proc, count_lines, free_port, wait_for
from node.sim_report import summarize
from protocol.identity import NodeKey

log = logging.getLogger("chaos")

KINDS = ["kill", "pause", "slow_link", "partition", "disk_full", "flood"]
RELAY_TMPFS_MB = 48
"""The relay keeps a few versions of the tiny model (~1 MB each): 48 MB is room for them, small enough to fill."""
FLOOD_CONNECTIONS = 200
QUIET_S = 60
"""Seconds of fault-free training before the first fault: steps/min there is the peer figure."""


class Role(Proc):
    def pause(self) -> None:
        if self.alive():
            os.killpg(self.p.pid, signal.SIGSTOP)
            self.events.append((time.time(), "pause"))

    def resume(self) -> None:
        if self.p is not None:
            try:
                os.killpg(self.p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.events.append((time.time(), "resume"))


class Chaos:
    def __init__(self, out: Path, seed: int, inference_nodes: int, cheaters: int, batch_groups: int, group_size: int,
                 k: int):
        self.out, self.rng = out, random.Random(seed)
        out.mkdir(parents=True, exist_ok=True)
        self.n = inference_nodes
        self.keys = {name: NodeKey.generate() for name in ["coordinator", "trainer", "validator", "relay",
                                                           *[f"inference-{i}" for i in range(inference_nodes)]]}
        for name, key in self.keys.items():
            (out / name).mkdir(exist_ok=True)
            key.save(out / name / "node.key")
        self.proxy = FaultProxy(seed)
        self.origin, self.relay_port = free_port(), free_port()
        src_origin = self.proxy.add("src-origin", self.origin).listen_port
        src_relay = self.proxy.add("src-relay", self.relay_port).listen_port
        self.coord_port = free_port()
        self.cfg = {"run_id": f"chaos-{seed}", "task": "reverse", "batch_groups": batch_groups, "group_size": group_size,
                    "max_off_policy_steps": k, "verification_rate": 1.0, "heartbeat_interval_s": 2.0,
                    "dead_after_missed": 3, "lease_ttl_s": 60.0,
                    "shardcast_sources": [f"http://127.0.0.1:{src_origin}", f"http://127.0.0.1:{src_relay}"],
                    "trainer": self.keys["trainer"].peer_id, "validators": [self.keys["validator"].peer_id],
                    "listen": f"/ip4/127.0.0.1/tcp/{self.coord_port}", "status_port": free_port(),
                    "recipe": {"steps": 100000, "seed": seed}}
        (out / "run.toml").write_text(to_toml(self.cfg))
        self.cheater_names = [f"inference-{i}" for i in range(inference_nodes - cheaters, inference_nodes)]
        self.tmpfs = self._mount_relay_tmpfs()
        self.procs: dict[str, Role] = {}
        self.faults: list[dict] = []
        self.crashes: list[dict] = []
        self.step_times: list[float] = []
        self._expected_down: set[str] = set()
        self.quiet_steps_per_min = self.faulty_steps_per_min = None
        self._decks: dict[str, list[str]] = {}

    def _mount_relay_tmpfs(self) -> Path | None:
        path = self.out / "relay" / "shardcast"
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={RELAY_TMPFS_MB}m", "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            log.warning("no tmpfs for the relay (%s): disk_full faults are skipped", r.stderr.strip())
            return None
        return path

    def start(self) -> None:
        out = self.out
        addr_file = out / "coordinator" / "addr"
        addr_file.unlink(missing_ok=True)
        self.procs["coordinator"] = Role("coordinator", [
            "coordinator", "launch", "--config", str(out / "run.toml"), "--state", str(out / "coordinator"),
            "--key", str(out / "coordinator" / "node.key"), "--addr-file", str(addr_file)], out / "coordinator" / "log.txt")
        self.procs["coordinator"].start()
        real = wait_for(addr_file, self.procs["coordinator"], 120).splitlines()[0]
        spec = str(out / "coordinator" / "spec.json")
        kinds = ["reward", "tokens", "version"]

        def member(name: str, role: str, extra: list[str] = ()) -> Role:
            link = self.proxy.add(f"coord-{name}", self.coord_port)
            bootstrap = real.replace(f"/tcp/{self.coord_port}/", f"/tcp/{link.listen_port}/")
            argv = ["join", "--role", role, "--bootstrap", bootstrap, "--spec", spec, "--key",
                    str(out / name / "node.key"), "--workdir", str(out / name), *extra]
            if name in self.cheater_names:  # node/adversary.py: an inference node with its cheating hook
                return Role(name, ["--cheat", kinds[self.cheater_names.index(name) % 3], *argv], out / name / "log.txt",
                            module="node.adversary")
            return Role(name, argv, out / name / "log.txt")
        self.procs["trainer"] = member("trainer", "trainer", ["--shardcast-port", str(self.origin)])
        self.procs["validator"] = member("validator", "validator")
        self.procs["relay"] = member("relay", "relay", ["--shardcast-port", str(self.relay_port)])
        for i in range(self.n):
            name = f"inference-{i}"
            self.procs[name] = member(name, "inference")
        for name, p in self.procs.items():
            if name != "coordinator":
                p.start()

    # ---- monitoring ------------------------------------------------------------------------------
    def poll(self) -> None:
        """Record finished steps; restart (and count) any role that died on its own."""
        n = count_lines(self.out / "trainer" / "metrics.jsonl")
        while len(self.step_times) < n:
            self.step_times.append(time.time())
        for name, p in self.procs.items():
            if name not in self._expected_down and p.p is not None and not p.alive():
                code = p.p.returncode
                self._record("crashes.jsonl", {"role": name, "exit_code": code, "t": round(time.time() - self.t0, 1)})
                log.warning("CRASH: %s exited with %s on its own; restarting", name, code)
                p.start()

    def sleep(self, seconds: float) -> None:
        end = time.time() + seconds
        while time.time() < end:
            time.sleep(min(0.5, max(0.0, end - time.time())))
            self.poll()

    # ---- faults ----------------------------------------------------------------------------------
    def inject(self, kind: str) -> dict:
        rng, f = self.rng, {"kind": kind, "t": round(time.time() - self.t0, 1)}
        if kind == "kill":
            name = self._draw("kill", list(self.procs))
            f["target"] = name
            self._expected_down.add(name)
            self.procs[name].kill()
            self.sleep(rng.uniform(1, 5))
            self.procs[name].start()
            self._expected_down.discard(name)
        elif kind == "pause":
            name = rng.choice(list(self.procs))
            f["target"] = name
            self.procs[name].pause()
            self.sleep(rng.uniform(3, 10))
            self.procs[name].resume()
        elif kind == "slow_link":
            links = rng.sample(sorted(self.proxy.links), k=max(1, len(self.proxy.links) // 2))
            f["target"], f["latency_ms"] = links, rng.randint(100, 300)
            self.proxy.set_faults(links, latency_s=f["latency_ms"] / 1000, loss=0.05)
            self.sleep(rng.uniform(10, 30))
            self.proxy.heal(links)
        elif kind == "partition":
            group = rng.sample([f"inference-{i}" for i in range(self.n)], k=max(1, self.n // 2))
            f["target"] = group
            # The group is cut from the coordinator (leases, submissions, gossip through it). The
            # shardcast sources are URLs shared by every node, so the data plane is not split.
            self.proxy.set_faults([f"coord-{g}" for g in group], partitioned=True)
            self.sleep(rng.uniform(5, 20))
            self.proxy.heal([f"coord-{g}" for g in group])
        elif kind == "disk_full":
            f["target"] = "relay"
            filler = self.tmpfs / ".filler"
            with open(filler, "wb") as fh:
                try:
                    while True:
                        fh.write(b"\0" * (1 << 20))
                        fh.flush()
                except OSError:
                    pass
            self.sleep(rng.uniform(10, 30))
            filler.unlink(missing_ok=True)
        elif kind == "flood":
            ports = [self.coord_port, self.cfg["status_port"], self.origin, self.relay_port]
            f["target"] = ports
            f["connections"] = _flood(ports, FLOOD_CONNECTIONS, rng.uniform(5, 15), rng.randrange(1 << 30), self.poll)
        f["end"] = round(time.time() - self.t0, 1)
        return f

    def _draw(self, deck: str, items: list[str]) -> str:
        """Random order without starvation: every item once per shuffled round (so every kind of
        fault, and a kill of every role, comes up in a long enough run)."""
        cards = self._decks.setdefault(deck, [])
        if not cards:
            cards.extend(items)
            self.rng.shuffle(cards)
        return cards.pop()

    def _record(self, name: str, row: dict) -> None:
        """Everything the report needs goes to disk as it happens (the report is recomputed from files)."""
        with (self.out / name).open("a") as f:
            f.write(json.dumps(row) + "\n")

    def _meta(self, **kw) -> None:
        path = self.out / "chaos_meta.json"
        meta = json.loads(path.read_text()) if path.exists() else {}
        meta.update(kw)
        path.write_text(json.dumps(meta, indent=1))

    def run(self, minutes: float, gap: tuple[float, float]) -> None:
        self.t0 = time.time()
        self._meta(t0=self.t0, cfg=self.cfg, cheater_names=self.cheater_names, minutes=minutes)
        self.start()
        # Faults begin once the trainer has published version 0 and training is under way.
        while not self.step_times and time.time() - self.t0 < 600:
            self.sleep(1)
        log.info("first step after %.0f s; %d s without faults (the peer figure)", time.time() - self.t0, QUIET_S)
        q0, n0 = time.time(), len(self.step_times)
        self.sleep(QUIET_S)
        self.quiet_steps_per_min = (len(self.step_times) - n0) / ((time.time() - q0) / 60)
        log.info("quiet: %.1f steps/min; injecting faults for %.1f min", self.quiet_steps_per_min, minutes)
        f0, n1 = time.time(), len(self.step_times)
        end = time.time() + minutes * 60
        kinds = [k for k in KINDS if k != "disk_full" or self.tmpfs is not None]
        while time.time() < end:
            self.sleep(min(self.rng.uniform(*gap), max(0.0, end - time.time())))
            if time.time() >= end:
                break
            kind = self._draw("kind", kinds)
            f = self.inject(kind)
            log.info("fault %d: %s", len(self.faults) + 1, f)
            self.faults.append(f)
            self._record("faults.jsonl", f)
        self.faulty_steps_per_min = (len(self.step_times) - n1) / ((time.time() - f0) / 60)
        self._meta(faults_from=f0, faults_until=time.time(), quiet_steps_per_min=self.quiet_steps_per_min)
        self.sleep(30)  # quiet tail: every fault's recovery can be seen

    def stop(self) -> None:
        for name, p in self.procs.items():
            if name != "coordinator":
                p.resume()
                p.stop()
        self.procs["coordinator"].stop()
        self.proxy.close()
        if self.tmpfs is not None:
            subprocess.run(["umount", "-l", str(self.tmpfs)], check=False)


def report(out: Path, target: float) -> dict:
    """The figures of a chaos run, from its files alone: chaos_meta.json, faults.jsonl,
    crashes.jsonl, the trainer's metrics.jsonl and the coordinator's store."""
    meta = json.loads((out / "chaos_meta.json").read_text())
    t0, cfg, cheater_names = meta["t0"], meta["cfg"], meta["cheater_names"]
    faults = _jsonl(out / "faults.jsonl")
    crashes = _jsonl(out / "crashes.jsonl")
    raw = _jsonl(out / "trainer" / "metrics.jsonl")
    step_times = sorted(r["t"] for r in raw)
    # After a trainer SIGKILL the steps since its last checkpoint are trained again from the
    # same batches; the weights of the first attempt are gone, so only the last row of a step counts.
    by_step = {r["step"]: r for r in raw}
    rows = [by_step[s] for s in sorted(by_step)]
    keys = {p.name: NodeKey.load(p / "node.key") for p in out.iterdir() if (p / "node.key").exists()}
    k = cfg["max_off_policy_steps"]
    end = max([t0 + f["end"] for f in faults] + step_times + [t0])
    summary = summarize(out, rows, cfg, keys, cheater_names, end - t0, "chaos", t0)
    recov = []
    for f in faults:
        nxt = next((t for t in step_times if t >= t0 + f["end"]), None)
        f["recovery_s"] = None if nxt is None else round(nxt - (t0 + f["end"]), 2)
        if nxt is not None:
            recov.append(nxt - (t0 + f["end"]))
    recov.sort()
    by_kind: dict[str, int] = {}
    kills: dict[str, int] = {}
    for f in faults:
        by_kind[f["kind"]] = by_kind.get(f["kind"], 0) + 1
        if f["kind"] == "kill":
            kills[f["target"]] = kills.get(f["target"], 0) + 1
    pct = (lambda q: round(recov[min(len(recov) - 1, int(q * len(recov)))], 2) if recov else None)
    quiet = meta.get("quiet_steps_per_min")
    lo, hi = meta.get("faults_from"), meta.get("faults_until")
    under = (sum(lo <= t < hi for t in step_times) / ((hi - lo) / 60)) if lo and hi else None
    return {
        "faults_injected": len(faults), "faults_by_kind": by_kind, "kills_by_role": kills,
        "crashes": len(crashes), "crash_list": crashes,
        "rollouts_lost": summary["rollouts_lost"], "rollouts_duplicated": summary["rollouts_duplicated"],
        "off_policy_violations": sum(1 for r in rows for lag in r["lags"] if lag > k),
        "max_off_policy_seen": summary["max_off_policy_seen"], "max_off_policy_steps": k,
        "honest_banned": summary["honest_banned"], "cheaters": summary["cheaters"],
        "cheaters_missed": summary["cheaters"] - summary["cheaters_banned"],
        "recovery_s_p50": pct(0.5), "recovery_s_p99": pct(0.99), "recovery_s_max": round(recov[-1], 2) if recov else None,
        "faults_not_recovered": sum(f["recovery_s"] is None for f in faults),
        "recovery_s_by_kind": {kind: round(sorted(f["recovery_s"] for f in faults if f["kind"] == kind
                                                  and f["recovery_s"] is not None)[-1], 2)
                               for kind in by_kind if any(f["kind"] == kind and f["recovery_s"] is not None for f in faults)},
        "steps": len(rows), "steps_retrained_after_trainer_kill": len(raw) - len(rows),
        "reward_first": summary["reward_first"], "reward_last5": summary["reward_last5"],
        "reward_target": target,
        "reward_reached_target": bool(summary["reward_last5"] is not None and summary["reward_last5"] >= target),
        "rollouts_accepted": summary["rollouts_accepted"], "rollouts_trained": summary["rollouts_trained"],
        "rollouts_rejected": summary["rollouts_rejected"], "rollouts_dropped_stale": summary["rollouts_dropped_stale"],
        "steps_per_min_quiet": _r(quiet), "steps_per_min_under_faults": _r(under),
        "ratio_steps_under_faults_vs_quiet": _r(under / quiet) if quiet and under is not None else None,
        "wall_s": round(end - t0, 1),
    }, faults


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _flood(ports: list[int], n: int, hold_s: float, seed: int, tick) -> int:
    """Open `n` junk connections spread over `ports`, send random bytes on each, hold them open."""
    rng = random.Random(seed)
    socks = []
    for i in range(n):
        s = socket.socket()
        s.settimeout(1.0)
        try:
            s.connect(("127.0.0.1", ports[i % len(ports)]))
            s.sendall(rng.randbytes(rng.choice([1, 16, 300, 4096])))
            socks.append(s)
        except OSError:
            s.close()
    end = time.time() + hold_s
    while time.time() < end:
        tick()
        time.sleep(0.5)
    for s in socks:
        s.close()
    return len(socks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="minutes of fault injection (after the first step)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--inference-nodes", type=int, default=4)
    ap.add_argument("--cheaters", type=int, default=1)
    ap.add_argument("--batch-groups", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-off-policy-steps", type=int, default=1)
    ap.add_argument("--gap", type=float, nargs=2, default=(5.0, 20.0), help="seconds between faults (uniform)")
    ap.add_argument("--reward-target", type=float, default=0.6,
                    help="mean reward of the last 5 steps to reach (train-local passes 0.6 by step ~50)")
    ap.add_argument("--out", type=Path, default=Path("runs/chaos"))
    ap.add_argument("--result", type=Path, default=None, help="also write the JSON result here")
    ap.add_argument("--report-only", action="store_true", help="recompute the report of the run in --out")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    proxy_links = None
    if not args.report_only:
        chaos = Chaos(args.out, args.seed, args.inference_nodes, args.cheaters, args.batch_groups, args.group_size,
                      args.max_off_policy_steps)

        def interrupt(*_):
            raise KeyboardInterrupt
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, interrupt)
        try:
            chaos.run(args.minutes, tuple(args.gap))
        except KeyboardInterrupt:
            log.warning("interrupted; stopping the network and reporting what was seen")
        finally:
            chaos.stop()
        proxy_links = {n: {"connections": l.connections, "refused": l.refused, "mb": round(l.bytes / 1e6, 1)}
                       for n, l in chaos.proxy.links.items()}
    figures, faults = report(args.out, args.reward_target)
    meta = json.loads((args.out / "chaos_meta.json").read_text())
    result = {"benchmark": "chaos", "minutes": meta.get("minutes"), "seed": meta["cfg"]["run_id"].split("-")[-1],
              "machine": "cpu-2core", "load_avg_1m_at_report": round(os.getloadavg()[0], 2), **figures}
    if proxy_links is not None:
        result["proxy_links"] = proxy_links
    (args.out / "faults.json").write_text(json.dumps(faults, indent=1))
    if args.result:
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
