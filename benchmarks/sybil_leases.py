"""Sybil lease hoarding: honest training rate while 2 and 10 identities hoard leases, with the lease
policy (`protocol.pipeline.LeasePolicy`) and, as the peer in the same run, without it.

    python -m benchmarks.sybil_leases [--phase-s 20] [--rounds 3] [--out benchmarks/results/sybil_leases-cpu-2core.json]

A real coordinator (CoordinatorService, SQLite, libp2p on 127.0.0.1) and a named trainer (takes each
step's batch, then publishes the next version) run in this process; the honest members each in
their own process (`python -m benchmarks.sybil_leases honest ...`): 3 inference members (lease,
"generate" for GEN_S, submit a group) and a named validator (judges everything valid). The other
identities of a count share one process (`... hoard --identities N`, see `HOARDER_NICE`), each
with its own key and libp2p host; while switched on (SIGUSR1; SIGUSR2 off) each asks for 1,024
leases every 0.5 s claiming the newest policy version, and never submits (the red-team attack of
issue 17). Phases of `--phase-s` seconds: first without other identities, then for each count
(`--hoarders`) `--rounds` pairs of idle (joined, beating, not leasing) and hoarding phases, so the
hoarding is compared with the same peers on the same machine load (idle also shows what the peers
themselves cost on this machine). At each switch to idle the benchmark hands what the hoarders hold
back to the pool (as their lease expiry would a little later).

Figures: trainer steps per second (hoarding vs idle, hoarding vs none, idle vs none), the longest
gap between steps against the median step without other identities, the leases hoarders held, the
1-minute load average per phase. Prints progress, then one JSON line.

Why this shape (measured on the 2-core machine, all while other jobs ran): with one process per
hoarder at equal priority, 10 hoarder processes left the process holding the coordinator and every
honest member ~1/3 of a core and nothing was trained for a whole phase, with the policy and without
(the "10-hoarder stall" of the first measurement); at nice 19 the hoarders were too starved to send
their requests; with every honest member in the coordinator's process, 10 identities that only
joined and beat, leasing nothing, stalled it too (each of its 6 libp2p hosts connected to every
newcomer and ran gossip with it under one GIL).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("bench.sybil")

GEN_S = 0.3
"""Simulated generation time per work unit (an honest node's compute)."""
HONEST_NODES = 3
HOARDER_NICE = 0
"""Scheduling niceness of the hoarder process. On a network an attacker's identities run on the
attacker's machines; here they share 2 cores with the honest ones, so all identities of a count
share one process (one process per identity starved the coordinator's process: see the module
docstring)."""


CLAIMED_VERSION = 1 << 62
"""The policy version a hoarder says it holds: the coordinator grants leases only to a node whose
newest version could still yield an admissible rollout, and a liar claims one from the future (a
hoarder that reported the version it learnt by gossip fell behind, at nice 19, and got nothing)."""


async def hoard(bootstrap: str, spec_path: str, identities: int = 1) -> None:
    """`identities` identities in this process, each its own key and libp2p host. They start idle
    (join and beat only) and hoard while switched on: SIGUSR1 starts hoarding, SIGUSR2 stops it."""
    import signal

    hoarding = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, hoarding.set)
    loop.add_signal_handler(signal.SIGUSR2, hoarding.clear)
    await asyncio.gather(*(hoard_one(bootstrap, spec_path, hoarding) for _ in range(identities)))


async def hoard_one(bootstrap: str, spec_path: str, hoarding: asyncio.Event) -> None:
    """A hoarding identity: join; while `hoarding` is set, ask for 1,024 leases every 0.5 s; never submit."""
    from protocol.client import ONCE, CoordinatorClient
    from protocol.identity import NodeKey
    from protocol.member import RunMember
    from protocol.messages import RunSpec
    from protocol.transport import PeerHost

    spec = RunSpec.model_validate_json(Path(spec_path).read_bytes())
    key = NodeKey.generate()
    host = PeerHost(key)
    await host.start()
    member = RunMember(key, host, spec, "inference")
    await member.join(bootstrap)
    client = CoordinatorClient(member, retry=ONCE)
    while True:
        await hoarding.wait()
        try:
            await client.lease(1024, holds_version=CLAIMED_VERSION)
        except Exception as exc:  # refused, banned, coordinator gone: keep trying, as an attacker would
            log.debug("hoarder: %s", exc)
        await asyncio.sleep(0.5)


async def honest(bootstrap: str, spec_path: str, role: str, seed_hex: str) -> None:
    """An honest member in its own process (as on a network, where each has its own machine)."""
    from protocol.client import CoordinatorClient, Retry
    from protocol.identity import NodeKey
    from protocol.member import RunMember
    from protocol.messages import RunSpec
    from protocol.transport import PeerHost

    spec = RunSpec.model_validate_json(Path(spec_path).read_bytes())
    key = NodeKey.from_seed(bytes.fromhex(seed_hex))
    host = PeerHost(key)
    await host.start()
    member = RunMember(key, host, spec, role)
    await member.join(bootstrap)
    stop = asyncio.Event()
    client = CoordinatorClient(member, bootstrap, stop, Retry(first_delay_s=0.1, max_delay_s=0.5))
    await (honest_inference if role == "inference" else honest_validator)(client, stop)


async def honest_inference(client, stop: asyncio.Event) -> None:
    from protocol.errors import ProtocolError
    from protocol.messages import RolloutGroup, RolloutSubmission

    async def one(grant) -> None:
        await asyncio.sleep(GEN_S)
        v = grant.policy_version
        subs = [RolloutSubmission(work_id=grant.work_id, version_runs=[(v, 4)], token_ids=[4, 5, 6, 7],
                                  logprobs=[-0.1] * 4, reward=0.5, finish_reason="eos")]
        try:
            await client.submit(RolloutGroup(work_id=grant.work_id, rollouts=subs))
        except ProtocolError:
            pass  # stale, expired: an answer
    while not stop.is_set():
        try:
            grants = await client.lease(4)
        except ProtocolError:
            grants = []
        if grants:
            await asyncio.gather(*(one(g) for g in grants))
        else:
            await asyncio.sleep(0.1)


async def honest_validator(client, stop: asyncio.Event) -> None:
    from protocol.errors import ProtocolError
    from protocol.messages import Verdict
    while not stop.is_set():
        try:
            items = await client.to_verify(64)
            if items:
                await client.verdicts([Verdict(work_id=i.work_id, valid=True, submitter=i.submitter) for i in items])
        except ProtocolError:
            pass
        await asyncio.sleep(0.1)


async def trainer(client, stop: asyncio.Event, steps: list[float], groups: int) -> None:
    from protocol.errors import ProtocolError
    step = 1
    await client.announce(0, "00" * 32)
    while not stop.is_set():
        try:
            batch = await client.batch(step, groups)
        except ProtocolError:
            await asyncio.sleep(0.1)
            continue
        if len(batch) >= groups:
            steps.append(time.monotonic())
            await client.announce(step, f"{step:064x}")
            step += 1
        else:
            await asyncio.sleep(0.05)


async def one_run(tmp: Path, policy: bool, phase_s: float, batch_groups: int, counts: tuple[int, ...] = (2, 10),
                  nice: int = HOARDER_NICE, rounds: int = 3) -> dict:
    from protocol import pipeline
    from protocol.client import CoordinatorClient, Retry
    from protocol.coordinator import Coordinator
    from protocol.coordinator_service import CoordinatorService
    from protocol.identity import NodeKey
    from protocol.member import RunMember
    from protocol.messages import RunSpec
    from protocol.transport import PeerHost

    ck, tk, vseed = NodeKey.generate(), NodeKey.generate(), os.urandom(32)
    vk = NodeKey.from_seed(vseed)
    spec = RunSpec(run_id=f"sybil-{int(policy)}", coordinator=ck.peer_id, max_off_policy_steps=1,
                   heartbeat_interval_s=5.0, dead_after_missed=3, lease_ttl_s=30.0, group_size=1,
                   batch_groups=batch_groups, trainer=tk.peer_id, validators=[vk.peer_id])
    (tmp / "spec.json").write_text(spec.model_dump_json())
    host = PeerHost(ck)
    await host.start()
    svc = CoordinatorService(ck, Coordinator(tmp / "state", spec, synchronous="OFF"), host)
    svc.lease_policy = pipeline.LeasePolicy() if policy else None
    await svc.start()
    bootstrap = host.addrs[0] if "/p2p/" in host.addrs[0] else f"{host.addrs[0]}/p2p/{ck.peer_id}"
    stop = asyncio.Event()
    h = PeerHost(tk)
    await h.start()
    m = RunMember(tk, h, spec, "trainer")
    await m.join(bootstrap)
    trainer_client = CoordinatorClient(m, bootstrap, stop, Retry(first_delay_s=0.1, max_delay_s=0.5))
    members = [(vseed, "validator")] + [(os.urandom(32), "inference") for _ in range(HONEST_NODES)]
    honest_ids = [tk.peer_id] + [NodeKey.from_seed(seed).peer_id for seed, _ in members]
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.sybil_leases", "honest", "--bootstrap", bootstrap,
                               "--spec", str(tmp / "spec.json"), "--role", role, "--seed-hex", seed.hex()],
                              stdout=subprocess.DEVNULL, stderr=open(tmp / "honest.log", "ab"), env=dict(os.environ))
             for seed, role in members]
    joined_by = time.monotonic() + 120
    while len(svc.state.view.members) < len(honest_ids) and time.monotonic() < joined_by:
        await asyncio.sleep(0.5)
    steps: list[float] = []
    tasks = [asyncio.create_task(_logged(trainer(trainer_client, stop, steps, batch_groups)))]
    hoarders: list[subprocess.Popen] = []
    phases: dict[str, dict] = {}

    async def measure(name: str) -> dict:
        t0, first = time.monotonic(), len(steps)
        held, alive = [], []  # leases held by identities other than the honest ones; honest members live
        while time.monotonic() - t0 < phase_s:
            await asyncio.sleep(0.5)
            held.append(_held_by_others(svc, honest_ids))
            alive.append(sum(p in svc.state.view.members for p in honest_ids))
        t1 = time.monotonic()
        marks = [t0] + [s for s in steps[first:] if s <= t1] + [t1]
        gaps = [b - a for a, b in zip(marks, marks[1:])]
        out = {"seconds": round(t1 - t0, 1), "steps": len(marks) - 2, "longest_gap_s": round(max(gaps), 2),
               "step_gaps": [round(g, 2) for g in gaps[1:-1]], "hoarder_leases_held_max": max(held),
               "hoarder_leases_held_mean": round(sum(held) / len(held), 2), "honest_members_live_min": min(alive),
               "load_avg_1m": round(os.getloadavg()[0], 2)}
        log.info("policy %s, %s: %s", policy, name, {k: v for k, v in out.items() if k != "step_gaps"})
        return out
    try:
        await asyncio.sleep(phase_s / 2)  # warm-up: honest identities earn a record
        phases["none"] = await measure("no other identities")
        for n in counts:
            before = set(svc.state.view.members)
            hoarders.append(subprocess.Popen([sys.executable, "-m", "benchmarks.sybil_leases", "hoard", "--bootstrap",
                                              bootstrap, "--spec", str(tmp / "spec.json"), "--identities", str(n)],
                                             stdout=subprocess.DEVNULL, stderr=open(tmp / "hoarders.log", "ab"),
                                             env=dict(os.environ), preexec_fn=(lambda: os.nice(nice)) if nice else None))
            # measure from when every identity has joined (10 hosts starting on 2 cores take a while)
            joined_by = time.monotonic() + 120
            while len(set(svc.state.view.members) - before) < n and time.monotonic() < joined_by:
                await asyncio.sleep(0.5)
            idle, hoarding = [], []
            for _ in range(rounds):  # idle and hoarding alternate: the same peers, the same machine load
                idle.append(await measure(f"{n} identities idle"))
                hoarders[-1].send_signal(signal.SIGUSR1)
                hoarding.append(await measure(f"{n} identities hoarding"))
                hoarders[-1].send_signal(signal.SIGUSR2)
                await asyncio.sleep(1.0)  # requests already sent when it was switched off come back first
                with svc.state.store as db:  # what they hold goes back now, as its expiry would a little later
                    for peer in set(svc.state.view.members) - set(honest_ids):
                        db.release_leases_of(peer)
            hoarders[-1].kill()
            hoarders[-1].wait()
            phases[f"identities_{n}"] = {"idle": idle, "hoarding": hoarding}
    finally:
        stop.set()
        for p in hoarders + procs:
            p.kill()
            p.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await m.crash()
        await h.stop()
        await svc.stop()
        svc.state.close()
        await host.stop()
    return _figures(phases, counts)


def _figures(phases: dict, counts: tuple[int, ...]) -> dict:
    """Step rates per condition (steps over summed seconds), their ratios, and gaps against the
    median step of the phase without other identities."""
    def rate(ps: list[dict]) -> float:
        return sum(p["steps"] for p in ps) / sum(p["seconds"] for p in ps)
    none = phases["none"]
    base_rate, base_step = rate([none]), statistics.median(none["step_gaps"]) if none["step_gaps"] else None
    out = {"none": {k: v for k, v in none.items() if k != "step_gaps"} | {"steps_per_s": round(base_rate, 3)}}
    for n in counts:
        idle, hoarding = phases[f"identities_{n}"]["idle"], phases[f"identities_{n}"]["hoarding"]
        out[f"identities_{n}"] = {
            "steps_per_s_idle": round(rate(idle), 3), "steps_per_s_hoarding": round(rate(hoarding), 3),
            "hoarding_vs_idle": round(rate(hoarding) / rate(idle), 3) if rate(idle) else None,
            "hoarding_vs_none": round(rate(hoarding) / base_rate, 3) if base_rate else None,
            "idle_vs_none": round(rate(idle) / base_rate, 3) if base_rate else None,
            "longest_gap_hoarding_s": max(p["longest_gap_s"] for p in hoarding),
            "longest_gap_idle_s": max(p["longest_gap_s"] for p in idle),
            "median_step_none_s": round(base_step, 2) if base_step else None,
            "hoarder_leases_held_mean": round(statistics.mean(p["hoarder_leases_held_mean"] for p in hoarding), 2),
            "hoarder_leases_held_max": max(p["hoarder_leases_held_max"] for p in hoarding),
            "load_avg_1m": [p["load_avg_1m"] for p in idle + hoarding],
            "phases": {"idle": [{k: v for k, v in p.items() if k != "step_gaps"} for p in idle],
                       "hoarding": [{k: v for k, v in p.items() if k != "step_gaps"} for p in hoarding]}}
    return out


async def _logged(coro) -> None:
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("an honest member's loop failed")
        raise


def _held_by_others(svc, honest: list[str]) -> int:
    return svc.state.store.leased_count() - sum(svc.state.store.leased_count(holder=p) for p in honest)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="run", choices=["run", "hoard", "honest"])
    ap.add_argument("--role", default="inference")
    ap.add_argument("--seed-hex")
    ap.add_argument("--bootstrap")
    ap.add_argument("--spec")
    ap.add_argument("--phase-s", type=float, default=20.0, help="seconds per measured phase")
    ap.add_argument("--rounds", type=int, default=3, help="idle/hoarding phase pairs per identity count")
    ap.add_argument("--batch-groups", type=int, default=8)
    ap.add_argument("--hoarders", default="2,10", help="identity counts measured, one after the other")
    ap.add_argument("--nice", type=int, default=HOARDER_NICE, help="niceness of the hoarder processes (HOARDER_NICE)")
    ap.add_argument("--identities", type=int, default=1, help="hoard mode: identities in this process")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    for noisy in ("libp2p", "protocol", "protocol.client"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if args.mode == "honest":
        asyncio.run(honest(args.bootstrap, args.spec, args.role, args.seed_hex))
        return 0
    if args.mode == "hoard":
        asyncio.run(hoard(args.bootstrap, args.spec, args.identities))
        return 0
    counts = tuple(int(n) for n in args.hoarders.split(","))
    t0 = time.monotonic()
    result = {"bench": "sybil_leases", "machine": platform.node(), "phase_s": args.phase_s, "rounds": args.rounds,
              "batch_groups": args.batch_groups, "honest_inference_nodes": HONEST_NODES, "gen_s": GEN_S,
              "hoarder_nice": args.nice, "load_avg_1m_start": round(os.getloadavg()[0], 2),
              "command": f"python -m benchmarks.sybil_leases --phase-s {args.phase_s:g} --rounds {args.rounds} "
                         f"--hoarders {args.hoarders} --nice {args.nice}"}
    runs = {"with_policy": True, "without_policy": False}  # the policy, and the peer in the same run
    with tempfile.TemporaryDirectory() as tmp:
        for name, policy in runs.items():
            d = Path(tmp) / name
            d.mkdir()
            result[name] = asyncio.run(one_run(d, policy, args.phase_s, args.batch_groups, counts, args.nice,
                                               args.rounds))
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    keys = ("hoarding_vs_idle", "hoarding_vs_none", "idle_vs_none", "longest_gap_hoarding_s", "longest_gap_idle_s",
            "median_step_none_s", "hoarder_leases_held_mean")
    result["summary"] = {f"{n}_identities": {f"{k}_{'with' if policy else 'without'}": result[name][f"identities_{n}"][k]
                                             for name, policy in runs.items() for k in keys}
                         for n in counts}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
