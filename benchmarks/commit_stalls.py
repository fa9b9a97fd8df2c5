"""What a big write to the coordinator's disk does to its answers: members leasing and submitting through the
coordinator role's service (real libp2p on 127.0.0.1, the real store), and a validator member pulling their units
and sending verdicts, while another process writes a policy version's worth of bytes and fsyncs them, as the
trainer's store does on one host: to the coordinator's disk, or (`--writer-dir /dev/shm/...`) where
`join --store-payloads` keeps a version's payload.

    python -m benchmarks.commit_stalls [--write-gb 4] [--members 4] [--modes inline,deferred_s21,deferred]
                                       [--writer-dir DIR] [--writers write-behind,end]

Modes: `inline` is the store as every coordinator ran it before session 18 (each commit and segment append
fsynced on the event loop, `CoordinatorStore(defer_fsync=False)`); `deferred_s21` defers them (one fsync on a
worker thread serves every reply waiting, `SyncBarrier`) with every reply but a lease waiting for it, as
main did until session 22; `deferred` is what `coordinator launch` runs now: the validator's verify requests
and verdicts answered from the written commit too (`NOT_AWAITING_DISK`). Figures per mode, over the writer's
window (from its first byte to its fsync's end): each member call's latency (lease, submit, verify: a verify
request that returned units, held while there were none (a long poll: its time includes waiting for work),
verdicts), the validator's rounds a second (`verdicts_per_s`), the event loop's lag (a 10 ms ticker's lateness: what every heartbeat,
held request and gossip message waits), and calls completed. The peer is the same workload with no writer
(`idle`). One JSON line at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import protocol.coordinator_service as coordinator_service
from benchmarks.protocol import coordinator_and_members, pct, rollout, stop_coordinator_and_members
from protocol.client import CoordinatorClient
from protocol.coordinator import Coordinator
from protocol.identity import NodeKey
from protocol.messages import LeaseBatchRequest, RunSpec, Verdict

WRITER = """
import os, sys, time
from shardcast.write_behind import write_behind
path, total, behind = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "write-behind"
buf = os.urandom(16 << 20)
print(time.time(), flush=True)
with open(path, "wb") as f:
    for _ in range(total // len(buf)):
        write_behind(f, buf) if behind else f.write(buf)
    f.flush()
    os.fsync(f.fileno())
print(time.time(), flush=True)
"""
"""GBs written the way the trainer's store writes a version to the disk the coordinator shares: 16 MB writes,
then one fsync. `write-behind`: each write's writeback started as it goes (`shardcast.write_behind`: how a
publisher writes its wire shards once it has announced the version, since session 23); `end`: all left to
the kernel (how it wrote them before, and how it still writes a payload kept on the disk, since members wait
for that one: `--store-payloads` keeps it off)."""


async def one_mode(mode: str, workdir: Path, members_n: int, write_bytes: int, idle_s: float,
                   writer_dir: Path, writer: str = "end") -> dict:
    ck, vk = NodeKey.generate(), NodeKey.generate()
    spec = RunSpec(run_id="stalls", coordinator=ck.peer_id, max_off_policy_steps=4, heartbeat_interval_s=5.0,
                   lease_ttl_s=600, batch_groups=65_536, validators=[vk.peer_id])
    state = Coordinator(workdir / f"state-{mode}-{write_bytes}-{writer}", spec, defer_fsync=mode != "inline")
    now = coordinator_service.NOT_AWAITING_DISK
    if mode == "deferred_s21":  # the service reads the set as it starts
        coordinator_service.NOT_AWAITING_DISK = (LeaseBatchRequest,)
    try:
        service, clients = await coordinator_and_members(ck, state, members_n, request_timeout=60, validators=(vk,))
    finally:
        coordinator_service.NOT_AWAITING_DISK = now
    clients, validator = clients[:-1], clients[-1]
    calls: list[tuple[str, float, float]] = []  # (kind, wall time at the end, seconds)
    lags: list[tuple[float, float]] = []
    stop = asyncio.Event()

    async def member(c: CoordinatorClient) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            grants = await c.lease(1)
            calls.append(("lease", time.time(), time.perf_counter() - t))
            for g in grants:
                t = time.perf_counter()
                await c.submit(rollout(g.work_id))
                calls.append(("submit", time.time(), time.perf_counter() - t))

    async def judge() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            items = await validator.to_verify(16)
            if not items:  # held up to HOLD_S for work: not a latency
                continue
            calls.append(("verify", time.time(), time.perf_counter() - t))
            t = time.perf_counter()
            await validator.verdicts([Verdict(work_id=i.work_id, submitter=i.submitter, valid=True) for i in items])
            calls.append(("verdicts", time.time(), time.perf_counter() - t))

    async def ticker() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append((time.time(), time.perf_counter() - t - 0.01))

    tasks = [asyncio.create_task(member(c)) for c in clients] + [asyncio.create_task(ticker()),
                                                                  asyncio.create_task(judge())]
    await asyncio.sleep(1.0)  # warm
    if write_bytes:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", WRITER, str(writer_dir / f"version-{mode}.bin"),
                                                    str(write_bytes), writer, stdout=subprocess.PIPE,
                                                    cwd=Path(__file__).resolve().parents[1])  # imports shardcast
        out, _ = await proc.communicate()
        t0, t1 = (float(x) for x in out.decode().split())
    else:
        t0 = time.time()
        await asyncio.sleep(idle_s)
        t1 = time.time()
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
    await stop_coordinator_and_members(service, [*clients, validator])
    if write_bytes:  # deleting GBs of dirty pages blocks the caller: after the figures' window, off their loop
        os.remove(writer_dir / f"version-{mode}.bin")
    window = [(k, s) for k, end, s in calls if t0 <= end <= t1 + 0.5]
    lag = [s for end, s in lags if t0 <= end <= t1 + 0.5]
    out = {"window_s": round(t1 - t0, 2), "loop_lag_max_s": round(max(lag, default=0.0), 4),
           "loop_lag_p99_s": round(pct(lag, 0.99), 4) if lag else None}
    for kind in ("lease", "submit", "verify", "verdicts"):
        xs = [s for k, s in window if k == kind]
        out[kind] = {"calls": len(xs), "p50_s": round(pct(xs, 0.5), 4) if xs else None,
                     "p99_s": round(pct(xs, 0.99), 4) if xs else None, "max_s": round(max(xs, default=0.0), 4)}
    out["calls_per_s"] = round(len(window) / max(1e-9, t1 - t0), 1)
    out["verdicts_per_s"] = round(sum(k == "verdicts" for k, _ in window) / max(1e-9, t1 - t0), 1)
    print(f"[{mode}{f' + writer {writer}' if write_bytes else ''}] {json.dumps(out)}", flush=True)
    return out


async def main_async(args: argparse.Namespace) -> dict:
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="commit-stalls-"))
    workdir.mkdir(parents=True, exist_ok=True)
    writer_dir = Path(args.writer_dir) if args.writer_dir else workdir
    writer_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"benchmark": "commit_stalls", "machine": args.machine, "write_gb": args.write_gb,
                    "members": args.members, "validators": 1, "dir": str(workdir), "writer_dir": str(writer_dir),
                    "writers": args.writers}
    writers = args.writers.split(",")
    for mode in args.modes.split(","):
        result[f"{mode}_idle"] = await one_mode(mode, workdir, args.members, 0, args.idle_s, writer_dir)
        for writer in writers:  # the first writer's figures under the mode's name, the others' beside them
            key = mode if writer == writers[0] else f"{mode}_writer_{writer}"
            result[key] = await one_mode(mode, workdir, args.members, int(args.write_gb * (1 << 30)), 0, writer_dir,
                                         writer)
    if "deferred" in result and "deferred_writer_end" in result:  # written behind (the store now) vs not
        a, b = result["deferred_writer_end"], result["deferred"]
        for kind in ("submit", "verify"):
            result[f"{kind}_max_end_over_write_behind"] = round(a[kind]["max_s"] / max(1e-4, b[kind]["max_s"]), 2)
            result[f"{kind}_p99_end_over_write_behind"] = round(a[kind]["p99_s"] / max(1e-4, b[kind]["p99_s"]), 2)
        result["write_window_end_over_write_behind"] = round(a["window_s"] / max(1e-4, b["window_s"]), 2)
    if "inline" in result and "deferred" in result:
        a, b = result["inline"], result["deferred"]
        result["loop_lag_max_inline_over_deferred"] = round(a["loop_lag_max_s"] / max(1e-4, b["loop_lag_max_s"]), 1)
        result["lease_max_inline_over_deferred"] = round(a["lease"]["max_s"] / max(1e-4, b["lease"]["max_s"]), 2)
        result["calls_per_s_deferred_over_inline"] = round(b["calls_per_s"] / max(1e-9, a["calls_per_s"]), 2)
    if "deferred_s21" in result and "deferred" in result:
        a, b = result["deferred_s21"], result["deferred"]
        if a["verdicts"]["max_s"] and b["verdicts"]["max_s"]:
            result["verdicts_max_s21_over_now"] = round(a["verdicts"]["max_s"] / max(1e-4, b["verdicts"]["max_s"]), 2)
        result["judged_per_s_now_over_s21"] = round(b["verdicts_per_s"] / max(1e-9, a["verdicts_per_s"]), 2)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write-gb", type=float, default=4.0, help="bytes the other process writes (a policy version)")
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--modes", default="inline,deferred_s21,deferred")
    p.add_argument("--writer-dir", default=None, help="where the writer writes (default: the coordinator's dir; "
                                                         "/dev/shm/...: a payload kept off the disk)")
    p.add_argument("--writers", default="end",
                   help="how the other process writes, one run each (comma-separated; the first's figures under the "
                        "mode's name): end (all left to the kernel: a payload on the disk, and every run before "
                        "session 23), write-behind (each 16 MB's writeback started as it goes: a publisher's wire "
                        "shards now)")
    p.add_argument("--idle-s", type=float, default=5.0, help="the no-writer peer's window")
    p.add_argument("--dir", default=None, help="where the state and the written file go (default: a temp dir)")
    p.add_argument("--machine", default="cpu-2core")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    result = asyncio.run(main_async(args))
    line = json.dumps(result)
    if args.out:
        args.out.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
