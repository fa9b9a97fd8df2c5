"""Sybil lease hoarding: honest training rate with 0, 2 and 10 hoarding identities, with the lease
policy (`protocol.pipeline.LeasePolicy`) and, as the peer in the same run, without it.

    python -m benchmarks.sybil_leases [--phase-s 40] [--out benchmarks/results/sybil_leases-cpu-2core.json]

A real coordinator (CoordinatorService, SQLite, libp2p on 127.0.0.1) and a named trainer (takes each
step's batch, then publishes the next version) in this process; the honest members each in their own
process (`python -m benchmarks.sybil_leases honest ...`): 3 inference members (lease, "generate" for
GEN_S, submit a group) and a named validator (judges everything valid). With every honest member in
this one process (the first measurements), 10 newcomers that only joined and beat, leasing nothing,
stalled it for a whole phase (load 17): each of its 6 libp2p hosts connected to every newcomer and ran
gossip with it under one GIL; on a network each member has its own machine for its connections. Hoarders are separate OS processes (`python -m benchmarks.sybil_leases
hoard ...`, one per phase holding that phase's new identities: see `HOARDER_NICE` for why), each
identity fresh, asking for 1,024 leases every 0.5 s, claiming the newest policy version, and never
submitting (the red-team attack of issue 17). Each run has phases of
`--phase-s` seconds: none, then 2, then 10 hoarders (`--hoarders`; started at the phase's start).
A third run is the control: as many identities that join and beat but never lease (with the policy),
to tell the cost of hoarding from the cost of more peers in one process.
Figures per phase: trainer steps per second, its ratio to the no-hoarder phase, the longest gap
between two steps against the median step time of the no-hoarder phase, the leases hoarders held,
how far the honest members' newest policy version lagged, and the 1-minute load average.
Prints progress, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
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
"""Scheduling niceness of the hoarder processes. The hoarding identities of a phase share ONE
process (each its own key and libp2p host): on a network an attacker's identities run on the
attacker's machines, and here they share 2 cores with the one process that holds the coordinator
and every honest member. With one process per identity, 10 busy hoarder processes at equal priority
took ~10/11 of the CPU from that process (measured: it got ~1/3 of a core at load 14-22 and served
nothing for the whole phase, with policy and without: the "10-hoarder stall" of the first
measurement), which measures the machine's scheduler, not the lease policy; at nice 19 they were
too starved to send their requests. The idle-identity control run has the same processes."""


CLAIMED_VERSION = 1 << 62
"""The policy version a hoarder says it holds: the coordinator grants leases only to a node whose
newest version could still yield an admissible rollout, and a liar claims one from the future (a
hoarder that reported the version it learnt by gossip fell behind, at nice 19, and got nothing)."""


async def hoard(bootstrap: str, spec_path: str, idle: bool = False, identities: int = 1) -> None:
    """`identities` hoarding identities in this process, each its own key and libp2p host."""
    await asyncio.gather(*(hoard_one(bootstrap, spec_path, idle) for _ in range(identities)))


async def hoard_one(bootstrap: str, spec_path: str, idle: bool = False) -> None:
    """A hoarding identity: join, then ask for 1,024 leases every 0.5 s forever; never submit.
    `idle`: join and beat only (the control: what a member costs the others without hoarding)."""
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
    while idle:
        await asyncio.sleep(3600)
    while True:
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
    from protocol.envelope import open_envelope
    from protocol.errors import ProtocolError
    from protocol.messages import Verdict
    while not stop.is_set():
        try:
            items = await client.to_verify(64)
            if items:
                await client.verdicts([Verdict(work_id=i.work_id, valid=True, submitter=open_envelope(
                    i.envelope, client.member.spec.run_id, None, max_skew_s=float("inf")).signer) for i in items])
        except ProtocolError:
            pass
        await asyncio.sleep(0.1)


async def trainer(client, stop: asyncio.Event, steps: list[float], groups: int) -> None:
    from protocol.errors import ProtocolError
    step = 1
    await client.publish(0, "00" * 32)
    while not stop.is_set():
        try:
            batch = await client.batch(step, groups)
        except ProtocolError:
            await asyncio.sleep(0.1)
            continue
        if len(batch.items) >= groups:
            steps.append(time.monotonic())
            await client.publish(step, f"{step:064x}")
            step += 1
        else:
            await asyncio.sleep(0.05)


async def one_run(tmp: Path, policy: bool, phase_s: float, batch_groups: int, counts: tuple[int, ...] = (0, 2, 10),
                  nice: int = HOARDER_NICE, idle: bool = False) -> dict:
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
    started = 0  # hoarding identities started so far
    phases = {}
    try:
        await asyncio.sleep(phase_s / 2)  # warm-up: honest identities earn a record
        for n in counts:
            if n > started:  # one more process with this phase's new identities
                hoarders.append(subprocess.Popen([sys.executable, "-m", "benchmarks.sybil_leases", "hoard", "--bootstrap",
                                                  bootstrap, "--spec", str(tmp / "spec.json"), "--identities",
                                                  str(n - started)] + ["--idle"] * idle,
                                                 stdout=subprocess.DEVNULL, stderr=open(tmp / "hoarders.log", "ab"),
                                                 env=dict(os.environ), preexec_fn=(lambda: os.nice(nice)) if nice else None))
                started = n
            # measure from when every hoarder has joined (10 hosts starting on 2 cores take a while)
            joined_by = time.monotonic() + 120
            while len(svc.state.view.members) < len(honest_ids) + n and time.monotonic() < joined_by:
                await asyncio.sleep(0.5)
            t0 = time.monotonic()
            first = len(steps)
            held = []  # leases held by identities other than the honest ones, sampled every 0.5 s
            alive = []  # honest members the coordinator counts as live
            while time.monotonic() - t0 < phase_s:
                await asyncio.sleep(0.5)
                held.append(_held_by_others(svc, honest_ids))
                alive.append(sum(p in svc.state.view.members for p in honest_ids))
            t1 = time.monotonic()
            marks = [t0] + [s for s in steps[first:] if s <= t1] + [t1]
            gaps = [b - a for a, b in zip(marks, marks[1:])]
            done = len(marks) - 2
            phases[f"hoarders_{n}"] = {"steps": done, "steps_per_s": round(done / (t1 - t0), 3),
                                      "longest_gap_s": round(max(gaps), 2),
                                      "median_step_s": round(statistics.median(gaps[1:-1]), 2) if done > 1 else None,
                                      "hoarder_leases_held_max": max(held), "hoarder_leases_held_mean":
                                      round(sum(held) / len(held), 2),
                                      "honest_members_live_min": min(alive),
                                      "load_avg_1m": round(os.getloadavg()[0], 2),
                                      "pool": pipeline.out_limit(spec.max_off_policy_steps, spec.batch_groups)}
            log.info("policy %s, %d %s: %s", policy, n, "idle identities" if idle else "hoarders",
                     phases[f"hoarders_{n}"])
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
    base = phases["hoarders_0"]
    for name, p in phases.items():
        p["rate_vs_no_hoarders"] = round(p["steps_per_s"] / base["steps_per_s"], 3) if base["steps_per_s"] else None
        p["longest_gap_vs_median_step"] = (round(p["longest_gap_s"] / base["median_step_s"], 2)
                                           if base["median_step_s"] else None)
    return phases


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
    ap.add_argument("--phase-s", type=float, default=40.0, help="seconds per phase (0, 2, 10 hoarders)")
    ap.add_argument("--batch-groups", type=int, default=8)
    ap.add_argument("--hoarders", default="2,10", help="hoarding identities per measured phase (after one without)")
    ap.add_argument("--nice", type=int, default=HOARDER_NICE, help="niceness of the hoarder processes (HOARDER_NICE)")
    ap.add_argument("--idle", action="store_true", help="hoard mode: join and beat, never lease")
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
        asyncio.run(hoard(args.bootstrap, args.spec, args.idle, args.identities))
        return 0
    counts = tuple(int(n) for n in args.hoarders.split(","))
    result = {"bench": "sybil_leases", "machine": platform.node(), "phase_s": args.phase_s,
              "batch_groups": args.batch_groups, "honest_inference_nodes": HONEST_NODES, "gen_s": GEN_S,
              "hoarder_nice": args.nice, "load_avg_1m_start": round(os.getloadavg()[0], 2),
              "command": f"python -m benchmarks.sybil_leases --phase-s {args.phase_s:g} --hoarders {args.hoarders} "
                         f"--nice {args.nice}"}
    # with the policy; without it (the peer); and the control: as many identities that only join
    # and beat, with the policy (what their mere membership costs a process that hosts 6 peers)
    runs = {"with_policy": (True, False), "without_policy": (False, False), "idle_identities_control": (True, True)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (policy, idle) in runs.items():
            d = Path(tmp) / name
            d.mkdir()
            result[name] = asyncio.run(one_run(d, policy, args.phase_s, args.batch_groups, (0,) + counts, args.nice,
                                               idle))
    w, wo, ctl = (result[name] for name in runs)
    result["summary"] = {f"{k}_hoarders": {"rate_with": w[f"hoarders_{k}"]["rate_vs_no_hoarders"],
                                           "rate_without": wo[f"hoarders_{k}"]["rate_vs_no_hoarders"],
                                           "rate_idle_control": ctl[f"hoarders_{k}"]["rate_vs_no_hoarders"],
                                           "longest_gap_vs_median_step_with": w[f"hoarders_{k}"]["longest_gap_vs_median_step"],
                                           "longest_gap_vs_median_step_without": wo[f"hoarders_{k}"]["longest_gap_vs_median_step"],
                                           "longest_gap_vs_median_step_no_hoarders_with": w["hoarders_0"]["longest_gap_vs_median_step"],
                                           "hoarder_leases_held_mean_with": w[f"hoarders_{k}"]["hoarder_leases_held_mean"],
                                           "hoarder_leases_held_mean_without": wo[f"hoarders_{k}"]["hoarder_leases_held_mean"]}
                         for k in counts}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
