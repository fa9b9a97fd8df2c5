"""The whole network on this host's GPUs, measured step by step: `primerl-node sim --device cuda`.

    python -m benchmarks.gpu_network [--model random:qwen3-30b-a3b-8l] [--ks 1,0] [--steps 20] [--out DIR]
    python -m benchmarks.gpu_network --reread DIR     # the figures again from a finished run's records

Its defaults on a GPU are the RL-shaped workload: the 5.2B 8-layer Qwen3-30B-A3B shape in bf16, 32 prompts x 8
samples a step, `reverse-text-long` (heavy-tailed completions up to 1,024 tokens), k = 1 and then k = 0, the
trainer's learning rate one whose step changes what an LLM RL step changes (`RANDOM_MODEL_LR`; since session 40).

Each k in `--ks` is one run of `sim` (coordinator and relay on the CPU; trainer on GPU 0; inference
nodes on the other GPUs with `builtin-cuda`; validator on the last GPU: node/sim_devices.py) with
`max_off_policy_steps = k`, every role its own process, all traffic over libp2p and HTTP on loopback.
Per step, from the roles' own records (trainer metrics.jsonl, inference and validator rounds.jsonl
and versions.jsonl, written by `join --trace-versions`):

- trainer: the step period (`step_s`: between two publications), waiting for the batch (`wait_s`:
  generation, verification and queueing upstream), compute (`train_s`), then waiting for the previous
  version's announcement and the wire shards of the one before it (`publish_wait_s`), publication to its
  announcement (`publish_s`) and its wire shards after (`wire_s`, beside the next version's publication); a
  steady delta's size on the wire (`wire_mib_per_delta`, `raw_over_wire_delta`);
- weight latency of version v: trainer step end -> the first rollout round on each inference node that
  sampled with v (the round's start, or when v was queued if the round was already running: the engine
  swaps between two decode steps), split into announce, fetch + verify, load, with the fetch's work in
  download / verify / decode / write seconds and the engine's own stage (off its thread) and swap
  (between two steps) seconds (swaps.jsonl), the stage's split per ring thread (`stage_host_s`: copying
  payload pages into pinned buffers, `stage_host_cpu_s` of it running; `stage_dma_wait_s`: waiting for the copies to the GPU); `store_disk`:
  the bytes the run's shardcast stores took on this host, per version held (every role shares one store: `sim`'s default);
- generation tok/s (busy and wall), verification tok/s (the validator's recomputed prompt + completion
  tokens per second of judging), GPU busy share per GPU (nvidia-smi, sampled every 0.5 s); the inference
  engine's sequences advanced per step and its step time (`engine_seqs_decoding_mean`, `engine_step_ms`);
- the validator's holds of new versions (`stalls`: `validator_hold_s`, `validator_holds_from_changes`);
- steady state: from the start of the first step after `--warmup` to the last step's publication, nothing
  before or after it (the roles starting; the processes stopping); `--reread DIR` recomputes a finished run's
  figures from its records;
- rollouts lost / duplicated / off-policy, from the coordinator's store (sim's audit).

The peer figure is the same run at k = 0 (synchronous) in the same invocation: `async_speedup` is the
steady-state step time at k = 0 over that at the largest k (`async_speedup_by_k`: over each k's). Steady state
drops the first `--warmup` steps. On a machine without CUDA, `--device cpu` runs the same network on the CPU (CI's
smoke test).
Writes OUT/result.json and OUT/report.png; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.gpu_network_report import plot
from node.sim import PRETRAINED_MAX_SEQ, run_sim
from node.sim_devices import place
from node.version_trace import FILE, judging_summary

log = logging.getLogger("benchmarks.gpu_network")

LONG_TASK_MAX_SEQ = 1536
"""Sequence limit with `--task reverse-text-long` (a prompt of up to ~400 tokens + up to 1,024 new)."""
RANDOM_MODEL_LR = {"float32": 1e-6, "bfloat16": 1e-5}
"""The learning rate with a `random:` model, by the trainer's master dtype (the run's: one process keeps no fp32
copy of a bf16 model): what makes a step change what an LLM RL step with an fp32 master changes (DAPO trains
Qwen2.5-32B at a constant 1e-6). Measured on CPU with N(0, 0.02) weights and real RL steps, published in bf16
(`python -m benchmarks.shardcast_delta --real --random qwen3-moe-tiny`, shardcast_delta-random-lr-cpu-2core.json):
an fp32 master at 1e-6 changed 2.6, 1.7, 1.5% of the elements at steps 1-3; a bf16 master 7.8, 2.4, 2.2% at 1e-5
(0.7% at 3e-6, its updates mostly below half a bf16 step and lost). Until session 40 these runs trained a bf16 master
at 3e-5: 15, 7.1, 6.9% (session 38's 5.2B validator held 5.1 GB for version 1's step, 8 bytes a changed element;
its delta versions were 150-739 MiB on the wire of 9,892 MiB, 23-37 s of encoding over 12 threads each). A random
model learns nothing at any rate."""
PRETRAINED_LR = 3e-5
"""The learning rate with a pretrained model (SmolLM2 learns `reverse-text` within a run at it)."""


def trainer_rows(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "trainer" / "metrics.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):
        start = r["t"] - r["step_s"]
        r["train_s"] = r["t_trained"] - start - r["wait_s"]  # the wait for the last publication comes after
        r.setdefault("publish_s", r["t"] - r["t_trained"])
        # the step's period: publication of step s overlaps the batch of s+1, so step_s (batch request ->
        # published) overstates what each step costs; the period is the time between two publications
        r["period_s"] = r["t"] - rows[i - 1]["t"] if i else r["step_s"]
    return rows


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def weight_latency(out: Path, n: int, rows: list[dict]) -> tuple[list[float], dict[str, list[float]], dict]:
    """Per version (and node): step end -> first round sampling with it; the stages of each; and a
    timeline {node: [(t, version)]} for the report."""
    trained = {r["step"]: r["t_trained"] for r in rows}
    from benchmarks.weight_latency import swaps

    lat, timeline = [], {}
    stages: dict[str, list[float]] = {"announce_s": [], "fetch_verify_s": [], "load_s": [], "download_s": [],
                                      "verify_s": [], "decode_s": [], "write_s": [], "swap_wait_s": [],
                                      "lease_wait_s": [], "admit_s": [], "stage_s": [], "stage_host_s": [],
                                      "stage_host_cpu_s": [], "stage_dma_wait_s": [],
                                      "swap_s": [], "staged_on_device": []}
    for i in range(n):
        node = out / f"inference-{i}"
        versions, rounds = _jsonl(node / "versions.jsonl"), _jsonl(node / "rounds.jsonl")
        applied = swaps(node)
        timeline[f"inference-{i}"] = [(r["t0"], max(r["versions"])) for r in rounds if r["versions"]]
        for v, t in sorted(trained.items()):
            queued = min((d for d in versions if d["version"] >= v), key=lambda d: d["t_queued"], default=None)
            # the engine's own record of the step that first sampled with v (or a newer version), else the
            # first activity row that sampled with it
            started = [ts for r in rounds for sv, ts in r.get("started", {}).items() if int(sv) >= v]
            first = min((r for r in rounds if r["versions"] and max(r["versions"]) >= v), key=lambda r: r["t1"],
                        default=None)
            if queued is None or (first is None and not started):
                continue
            lat.append((min(started) if started else max(first["t0"], queued["t_queued"])) - t)
            if queued["version"] == v and queued.get("t_announced"):
                stages["announce_s"].append(queued["t_announced"] - t)
                stages["fetch_verify_s"].append(queued["t_fetched"] - queued["t_fetch"])
                stages["load_s"].append(queued["t_queued"] - queued["t_fetched"])
                for key, x in (queued.get("fetch_stages_s") or {}).items():  # seconds of work over the fetch's workers
                    if key in stages:
                        stages[key].append(x)
                swap = applied.get(v)
                if swap is not None:  # the engine's record: staged off its thread, then swapped between two steps
                    stages["swap_wait_s"].append(swap["t_applied"] - queued["t_queued"])
                    if "t_granted" in swap:  # since session 32: queued -> leases granted -> applied
                        # None: applied before a lease holding it was granted (the engine had other work), so
                        # none of the wait was the lease's, and both lists cover every swap (their medians compare)
                        granted = max(queued["t_queued"], swap["t_granted"] or queued["t_queued"])
                        stages["lease_wait_s"].append(granted - queued["t_queued"])
                        stages["admit_s"].append(swap["t_applied"] - granted)
                    stages["stage_s"].append(swap.get("stage_s", 0.0))
                    if swap.get("ring_threads"):  # since session 33: the staging's ring threads, per thread
                        stages["stage_host_s"].append(swap["ring_host_s"] / swap["ring_threads"])
                        stages["stage_host_cpu_s"].append(swap.get("ring_host_cpu_s", 0.0) / swap["ring_threads"])
                        stages["stage_dma_wait_s"].append(swap["ring_wait_s"] / swap["ring_threads"])
                    stages["swap_s"].append(swap.get("apply_s", 0.0))
                    stages["staged_on_device"].append(float(bool(swap.get("staged_on_device"))))  # median 1: staged
    return lat, {k: v for k, v in stages.items() if v}, timeline


_SLOW_COMMITS = re.compile(r"coordinator store: (\d+) commits over [\d.]+ s in the last [\d.]+ s \(slowest ([\d.]+) s\)")
_LEASE_MAX = re.compile(r"granting lease calls, median [\d.]+ s, max ([\d.]+) s")


def stalls(out: Path, nodes: int, window: tuple[float, float]) -> dict:
    """Where the network stood still, from the roles' own logs and rounds: the coordinator's commits slower than 0.2 s
    over the whole run (their fsyncs behind other writes to this host's disk; the coordinator answers nothing
    meanwhile) and the slowest of them, the slowest granting lease call of any inference node, and the seconds of
    `window` in which an inference node ran no engine step at all (no round row: no work leased), and how long the
    validator's rounds waited for their turn on its model (behind a hold reading a version in: rows since session 22)."""
    text = (out / "coordinator" / "log.txt").read_text(errors="replace") if (out / "coordinator" / "log.txt").exists() else ""
    commits = [(int(n), float(worst)) for n, worst in _SLOW_COMMITS.findall(text)]
    lease_max, idle = [], 0.0
    for i in range(nodes):
        node_log = out / f"inference-{i}" / "log.txt"
        lease_max += [float(x) for x in _LEASE_MAX.findall(node_log.read_text(errors="replace"))] if node_log.exists() else []
        rounds = [r for r in _jsonl(out / f"inference-{i}" / "rounds.jsonl") if _inside(r, window)]
        for a, b in zip(rounds, rounds[1:]):
            idle += max(0.0, min(b["t0"], window[1]) - max(a["t1"], window[0]))
    judged = [r for r in _jsonl(out / "validator" / "rounds.jsonl") if _inside(r, window)]
    turn_waits = [r["turn_wait_s"] for r in judged if "turn_wait_s" in r]
    # the versions the validator held inside the window (rows since session 40): how long after each was fetched,
    # and how many had their step built from changed bytes rather than a whole read
    holds = [r for r in _jsonl(out / "validator" / FILE) if "hold_s" in r and window[0] <= r["t_held"] <= window[1]]
    return {"coordinator_slow_commits": sum(n for n, _ in commits),
            "validator_turn_wait_s": round(sum(turn_waits), 2) if turn_waits else None,
            "validator_turn_wait_max_s": round(max(turn_waits), 2) if turn_waits else None,
            # the round that recomputed longest, as its row says what it was (rows since session 25: versions,
            # mixed claims, alone on the model, the collector's seconds), and the collector over all rounds
            **judging_summary(judged),
            "validator_hold_s": round(statistics.median(r["hold_s"] for r in holds), 3) if holds else None,
            "validator_hold_max_s": round(max(r["hold_s"] for r in holds), 3) if holds else None,
            "validator_holds_from_changes": sum(r["changed_bytes"] is not None for r in holds) if holds else None,
            "validator_holds": len(holds),
            "coordinator_commit_max_s": max((w for _, w in commits), default=None),
            "lease_call_max_s": max(lease_max, default=None), "node_idle_s": round(idle, 2)}


def throughput(rounds: list[dict], window: tuple[float, float]) -> tuple[float, float, float]:
    """(tokens per busy second, busy seconds, tokens) of the rows inside `window` (a row is about a second of a
    role's work, longer than a steady window of fast steps may be: a row that straddles an end counts for the
    share of it inside; a validator's busy time is its recomputation, `verify_s`, without fetching versions; an
    inference node's the seconds inside engine steps, `busy_s`)."""
    busy = tokens = 0.0
    for r in rounds:
        share = _inside(r, window)
        busy += share * r.get("verify_s", r.get("busy_s", r["t1"] - r["t0"]))
        tokens += share * r["tokens"]
    return (tokens / busy if busy else 0.0), busy, tokens


def _inside(row: dict, window: tuple[float, float]) -> float:
    """The share of a round row's span [t0, t1] inside `window` (a row of no length: 1 or 0)."""
    t0, t1 = row["t0"], row["t1"]
    if t1 <= t0:
        return float(window[0] < t1 <= window[1])
    return max(0.0, min(t1, window[1]) - max(t0, window[0])) / (t1 - t0)


def phase_ms(stepped: list[tuple[float, dict]], n_steps: float) -> dict[str, dict[str, float]] | None:
    """Per engine step, each phase's wall and CPU milliseconds (rows' `phases` since session 42: node/engine/core.py
    `EngineCore.phases`; `finish` counts inside `decode` or `prefill`), weighted by each row's share of the window.
    Wall minus CPU is what the phase waited for the interpreter's lock, a sleeping call or a core. None without any."""
    sums: dict[str, list[float]] = {}
    for share, r in stepped:
        for name, (wall, cpu, _) in (r.get("phases") or {}).items():
            acc = sums.setdefault(name, [0.0, 0.0])
            acc[0] += share * wall
            acc[1] += share * cpu
    if not sums or not n_steps:
        return None
    return {name: {"wall": round(1000 * w / n_steps, 3), "cpu": round(1000 * c / n_steps, 3)}
            for name, (w, c) in sorted(sums.items())}


def thread_shares(stepped: list[tuple[float, dict]], top: int = 8) -> dict[str, dict[str, float]] | None:
    """The inference role's threads over the steady window (rows' `threads` laps since session 42:
    node/thread_cpu.py): per thread family, its seconds on a core (`cpu`) and ready but waiting for one (`runq`),
    each a share of the laps' wall time; the `top` families by CPU. A share above 1 is several threads. None
    where no row carries laps (older rows, or no /proc)."""
    wall, families = 0.0, {}
    for share, r in stepped:
        lap = r.get("threads")
        if not share or not lap:
            continue
        wall += share * lap["wall_s"]
        for name, f in lap["families"].items():
            acc = families.setdefault(name, [0.0, 0.0])
            acc[0] += share * f["cpu_s"]
            acc[1] += share * f["runq_s"]
    if not wall:
        return None
    ranked = sorted(families.items(), key=lambda kv: -kv[1][0])[:top]
    return {name: {"cpu": round(cpu / wall, 3), "runq": round(runq / wall, 3)} for name, (cpu, runq) in ranked}


def gpu_busy(path: Path, window: tuple[float, float] = (0.0, float("inf"))) -> dict[str, dict[str, float]]:
    """Mean utilization (nvidia-smi's share of time a kernel ran) and peak memory per GPU inside `window`, from a
    `GpuSampler` file."""
    per: dict[str, list[tuple[float, float]]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            t, idx, util, mem = (x.strip() for x in line.split(","))
            if window[0] <= float(t) <= window[1]:
                per.setdefault(f"cuda:{idx}", []).append((float(util), float(mem)))
        except ValueError:
            continue
    return {gpu: {"busy_share": round(statistics.mean(u for u, _ in xs) / 100, 3), "samples": len(xs),
                  "memory_gib_max": round(max(m for _, m in xs) / 1024, 1)} for gpu, xs in per.items()}


def memory_by_role(path: Path) -> dict[str, float]:
    """Peak GPU memory (GiB) of each role's process, from a `GpuSampler` apps file (`time, role, MiB` lines)."""
    peak: dict[str, float] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            _, name, mib = (x.strip() for x in line.rsplit(",", 2))
            peak[name] = max(peak.get(name, 0.0), float(mib))
        except ValueError:
            continue
    return {name: round(mib / 1024, 1) for name, mib in sorted(peak.items())}


class GpuSampler:
    """nvidia-smi's utilization of every GPU every 0.5 s into a file (`gpu_busy` reads it), and each process's
    memory every second, named by its role, into PATH.apps.csv (`memory_by_role`); nothing without nvidia-smi."""

    def __init__(self, path: Path):
        self.path, self.p, self.apps = path, None, None
        self._names: dict[str, str] = {}

    def __enter__(self) -> "GpuSampler":
        try:
            self.p = subprocess.Popen(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used",
                                       "--format=csv,noheader,nounits", "-lms", "500"],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self.apps = subprocess.Popen(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                          "--format=csv,noheader,nounits", "-lms", "1000"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._out = self.path.open("w")
            self._apps_out = self.path.with_suffix(".apps.csv").open("w")
            self._reader = threading.Thread(target=self._stamp, daemon=True)
            self._apps_reader = threading.Thread(target=self._stamp_apps, daemon=True)
            self._reader.start()
            self._apps_reader.start()
        except OSError:
            self.p = self.apps = None
        return self

    def _stamp(self) -> None:
        """Each sample line with the time it arrived (the steady window is cut by time)."""
        for line in self.p.stdout:
            self._out.write(f"{time.time():.2f}, {line}")
            self._out.flush()

    def _stamp_apps(self) -> None:
        """Each process's GPU memory, named by the role its command line runs (read while it lives)."""
        for line in self.apps.stdout:
            try:
                pid, mib = (x.strip() for x in line.split(","))
                name = self._names.get(pid) or self._names.setdefault(pid, role_of(pid))
                self._apps_out.write(f"{time.time():.2f}, {name}, {mib}\n")
                self._apps_out.flush()
            except ValueError:
                continue

    def __exit__(self, *exc) -> None:
        for proc, reader, out in ((self.p, "_reader", "_out"), (self.apps, "_apps_reader", "_apps_out")):
            if proc is not None:
                proc.terminate()
                proc.wait(10)
                getattr(self, reader).join(5)
                getattr(self, out).close()


def role_of(pid: str) -> str:
    """The sim member a process is (its `--workdir`'s name: trainer, validator, inference-0, ...), or `pid N`
    (a process of another namespace, or one gone)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return f"pid {pid}"
    if "--workdir" in argv and argv.index("--workdir") + 1 < len(argv):
        return Path(argv[argv.index("--workdir") + 1]).name
    return f"pid {pid} ({Path(argv[0]).name if argv and argv[0] else '?'})"


def speedups(runs: list[dict]) -> dict[int, float]:
    """Per k > 0 run: the k = 0 run's steady step over its own (empty without a k = 0 run, or where a step is
    missing); `async_speedup` is the largest k's, the issue's aim is k = 1's."""
    base = next((r["step_s"] for r in runs if r["k"] == 0), None)
    return {r["k"]: round(base / r["step_s"], 2) for r in sorted(runs, key=lambda r: r["k"])
            if r["k"] > 0 and base and r["step_s"]}


def run_one(args, k: int, model_run: dict, out: Path) -> dict:
    placement = place(args.device, args.inference_nodes)
    engine = "builtin-cuda" if args.device == "cuda" else "builtin"
    recipe = {**model_run.get("recipe", {}), "lr": args.lr, "temperature": 1.0}
    with GpuSampler(out.with_suffix(".gpu.csv")):
        t0 = time.time()
        summary = run_sim(out, inference_nodes=args.inference_nodes, steps=args.steps, task=args.task,
                          max_off_policy_steps=k, batch_groups=args.batch_groups, group_size=args.group_size,
                          timeout_s=args.timeout, recipe=recipe, model=model_run.get("model"), placement=placement,
                          engine=engine, fp8=args.fp8, run={"dead_after_missed": 10, "lease_ttl_s": 120.0}, mps=args.mps,
                          trainer_checkpoint_every=args.checkpoint_every, trainer_master_float32=args.master_float32,
                          coordinator_state=args.coordinator_state / f"k{k}" if args.coordinator_state else None,
                          store_dir=args.store_dir / f"k{k}" if args.store_dir else None,
                          store_payloads=args.store_payloads / f"k{k}" if args.store_payloads else None)
        wall = time.time() - t0
    from benchmarks.weight_latency import host_store_bytes

    disk = host_store_bytes(out)  # before drop_stores: what the run's versions took on this host's disk
    return {"k": k, "placement": placement.describe(), "engine": engine, "status": summary["status"],
            **figures(out, args.inference_nodes, args.warmup, args.group_size), "wall_s": round(wall, 1),
            "store_disk": disk, **{key: summary.get(key) for key in _AUDIT}}


_AUDIT = ("rollouts_lost", "rollouts_duplicated", "rollouts_rejected", "max_off_policy_seen", "max_off_policy_steps",
          "honest_banned")
"""sim's audit of a run (its summary.json), carried into the run's figures."""


def figures(out: Path, nodes: int, warmup: int, group_size: int) -> dict:
    """A finished run's figures from its roles' own records in `out` (and the GPU sampler's files beside it).
    Steady state is the window from the start of the first step after `warmup` to the last step's publication:
    rounds, GPU samples and stalls outside it (the roles starting, the last checkpoint, the processes stopping)
    count for nothing but the whole-run figures."""
    rows = trainer_rows(out) if (out / "trainer" / "metrics.jsonl").exists() else []
    steady = rows[warmup:] or rows
    lat, stages, timeline = weight_latency(out, nodes, steady)
    window = (steady[0]["t"] - steady[0]["step_s"], steady[-1]["t"]) if steady else (0.0, 0.0)
    steady_wall = window[1] - window[0]
    gen = [throughput(_jsonl(out / f"inference-{i}" / "rounds.jsonl"), window) for i in range(nodes)]
    ver = throughput(_jsonl(out / "validator" / "rounds.jsonl"), window)
    gen_busy = sum(g[2] for g in gen) / sum(g[1] for g in gen) if sum(g[1] for g in gen) else 0.0
    # sequences in an inference node's engine at once (its leased groups x group size; rows since session 22)
    in_flight = [r["in_flight_max"] * group_size for i in range(nodes)
                 for r in _jsonl(out / f"inference-{i}" / "rounds.jsonl") if _inside(r, window) and "in_flight_max" in r]
    med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    # the engine's own steps inside the window (rows since session 39): how many sequences a step advanced, and
    # how long a step took (the leased groups above count members that finished and wait for their group)
    stepped = [(_inside(r, window), r) for i in range(nodes) for r in _jsonl(out / f"inference-{i}" / "rounds.jsonl")
               if "steps" in r]
    n_steps = sum(share * r["steps"] for share, r in stepped)
    # each role's rate per trained token while it worked (the completions the validator judged, since session 41;
    # the trainer's update): what `back_to_back` adds up
    judged = [(_inside(r, window), r) for r in _jsonl(out / "validator" / "rounds.jsonl") if "completion_tokens" in r]
    judged_tokens = sum(share * r["completion_tokens"] for share, r in judged)
    updated = [r for r in steady if r.get("update_s")]
    return {
        "steps": len(rows), "steady_steps": len(steady), "steady_window_s": round(steady_wall, 1),
        "step_s": med([r["period_s"] for r in steady]), "step_latency_s": med([r["step_s"] for r in steady]),
        "wait_s": med([r["wait_s"] for r in steady]),
        "publish_wait_s": med([r.get("publish_wait_s", 0.0) for r in steady]),
        "train_s": med([r["train_s"] for r in steady]), "publish_s": med([r["publish_s"] for r in steady]),
        # train_s apart (the trainer role's rows since session 31): the batch built on the host, then the update
        "batch_s": med([r["batch_s"] for r in steady if "batch_s" in r]),
        "update_s": med([r["update_s"] for r in steady if "update_s" in r]),
        # the wire shards for other hosts, after the announcement (the trainer role's rows since session 16)
        "wire_s": med([r["wire_s"] for r in steady if "wire_s" in r]),
        # what a steady version weighs on the wire (the trainer role's rows since session 40): a delta's size says
        # how much one step changed (the learning rate's mark; the wire shards' encoding grows with it)
        "wire_mib_per_delta": med([r["wire_bytes"] / 2**20 for r in steady if r.get("encoding") == "delta"]),
        "raw_over_wire_delta": med([r["raw_bytes"] / r["wire_bytes"] for r in steady
                                    if r.get("encoding") == "delta" and r.get("wire_bytes")]),
        "weight_latency_s": med(lat), "weight_latency_max_s": round(max(lat), 3) if lat else None,
        "weight_latency_stages_s": {s: med(v) for s, v in stages.items()},
        "stalls": stalls(out, nodes, window),
        "gen_tok_s": round(sum(g[2] for g in gen) / steady_wall, 1) if steady_wall else None,
        "gen_tok_s_busy": round(gen_busy, 1), "verify_tok_s_busy": round(ver[0], 1),
        "node_seqs_in_flight": {"max": max(in_flight, default=None), "p50": med(in_flight)},
        "engine_seqs_decoding_mean": round(sum(share * r["decoding"] for share, r in stepped) / n_steps, 1)
        if n_steps else None,
        "engine_step_ms": round(1000 * sum(share * r["busy_s"] for share, r in stepped) / n_steps, 2) if n_steps else None,
        # of a step, the engine thread's CPU time (rows since session 41): the rest it waited for its process's
        # interpreter lock or for a core (a CUDA synchronisation spins: waiting on the GPU counts as CPU time)
        "engine_step_cpu_ms": round(1000 * sum(share * r["cpu_s"] for share, r in stepped) / n_steps, 2)
        if n_steps and all("cpu_s" in r for _, r in stepped) else None,
        # who else ran in the inference role's process (the engine thread's lock holders): CPU and run-queue shares
        "inference_threads": thread_shares(stepped),
        # of a step, the engine's phases (swap, prefill, decode, finish) on the wall and on the thread's CPU
        "engine_phases_ms": phase_ms(stepped, n_steps),
        "verify_over_generate": round(ver[0] / gen_busy, 2) if gen_busy else None,
        "verify_completion_tok_s_busy": round(judged_tokens / sum(share * r["verify_s"] for share, r in judged), 1)
        if judged_tokens else None,
        "train_tok_s_busy": round(sum(r["tokens"] for r in updated) / sum(r["update_s"] for r in updated), 1)
        if updated else None,
        "trained_tok_s": round(sum(r["tokens"] for r in steady) / sum(r["period_s"] for r in steady), 1) if steady else None,
        "reward_per_step": [round(r["reward_mean"], 4) for r in rows],
        "reward_mean_steady": round(statistics.mean(r["reward_mean"] for r in steady), 4) if steady else None,
        "gpus": gpu_busy(out.with_suffix(".gpu.csv"), window), "gpus_whole_run": gpu_busy(out.with_suffix(".gpu.csv")),
        "gpu_memory_gib_peak_by_role": memory_by_role(out.with_suffix(".gpu.apps.csv")),
        "_rows": rows, "_timeline": timeline,
    }


def drop_stores(run_dir: Path) -> None:
    """A finished run's shardcast stores and checkpoints (GBs per role: each keeps its versions) go before
    the next run starts: on the H200 host's 64 GB disk the second run filled it (after its figures are read)."""
    import shutil

    from shardcast.store import PAYLOAD_ROOT_FILE

    for d in [*run_dir.glob("shardcast"), *run_dir.glob("*/shardcast"), *run_dir.glob("*/checkpoint")]:
        marker = d / PAYLOAD_ROOT_FILE  # payloads kept elsewhere (sim --store-payloads) go too
        if marker.exists():
            shutil.rmtree(marker.read_text().strip(), ignore_errors=True)
        shutil.rmtree(d.resolve(), ignore_errors=True)  # a store linked elsewhere (sim --store-dir) goes where it lies


def engine_alone(args, model_run: dict, out: Path) -> dict:
    """The inference role's engine alone, built as `join` builds it (registry, memory plan, graphs), on the
    network's workload (the same task, group size and sampling; as many groups as a step trains), with
    nothing else on the GPU: the upper bound the network's generation is held against."""
    from node.engine import SamplingParams
    from node.engine import registry as engines
    from node.envs.rollout import run_episodes
    from node.roles.common import blank_model, check_device, model_config, tokenizer
    from protocol.messages import RunSpec
    from protocol.model_spec import ModelSpec
    from protocol.work import sampling_seed

    device = "cuda:0" if args.device == "cuda" else "cpu"
    check_device(device)
    spec = RunSpec(run_id="engine-alone", coordinator="c", environment=args.task, group_size=args.group_size,
                   model=ModelSpec(**model_run["model"]) if model_run.get("model") else ModelSpec(), recipe={})
    tok, cfg = tokenizer(spec), model_config(spec)
    name = "builtin-cuda" if args.device == "cuda" else "builtin"
    setup = engines.EngineSetup(model=lambda: blank_model(spec, device), hf_config=cfg.to_hf_dict(), max_batch=64 * args.group_size,
                                max_seq_len=cfg.max_position_embeddings, eos_id=tok.eos_id, encode=tok.encode,
                                decode=tok.decode, bos_id=tok.bos_id, capture_experts=True, workdir=out, salt="x",
                                device=device, fp8=args.fp8, min_batch=args.group_size)
    engine = engines.build(name, setup)
    engine.load_weights(_hf_state(spec), 0)
    from node.envs import get_env

    env = get_env(args.task)
    episodes = [(f"{w}-{j}", env.sample_task(10_000 + w), SamplingParams(temperature=1.0, seed=sampling_seed(w, j)))
                for w in range(args.batch_groups * 2) for j in range(args.group_size)]
    run_episodes(engine, env, tok, episodes[: args.group_size * 4])  # warm: first prefills, allocator
    engine.phases.take()
    t0 = time.time()
    tally: dict = {}
    rollouts = run_episodes(engine, env, tok, episodes, tally)
    wall = time.time() - t0
    tokens = sum(len(r.completion_ids) for r in rollouts)
    phases = engine.phases.take()
    engines.close(engine)
    return {"engine_alone_tok_s": round(tokens / wall, 1), "engine_alone_slots": setup.max_batch,
            "engine_alone_rollouts": len(rollouts), "engine_alone_tokens": tokens,
            # per step, as the network's `engine_seqs_decoding_mean` / `engine_step_ms` (the loop does nothing but
            # step: its wall is the seconds inside `Episodes.step`, what the role's busy seconds count)
            "engine_alone_seqs_decoding_mean": round(tally["decoding"] / tally["steps"], 1) if tally.get("steps") else None,
            "engine_alone_step_ms": round(1000 * wall / tally["steps"], 2) if tally.get("steps") else None,
            "engine_alone_step_cpu_ms": round(1000 * tally["cpu_s"] / tally["steps"], 2) if tally.get("steps")
            else None,
            "engine_alone_phases_ms": phase_ms([(1.0, {"phases": phases})], tally.get("steps", 0))}


def _hf_state(spec) -> dict:
    """Version 0's weights by their HF names, as shardcast hands them to the engine."""
    from node.model.checkpoint import state_dict_to_hf
    from node.roles.common import fresh_model

    return state_dict_to_hf(fresh_model(spec, "cpu"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--model", default=None, help="tiny-moe, smollm2-135m-instruct, an HF directory, or random:SHAPE "
                   "(benchmarks/random_checkpoint.py SHAPES; default: random:qwen3-30b-a3b-8l on cuda, the 5.2B "
                   "8-layer Qwen3-30B-A3B shape; smollm2-135m-instruct on the CPU)")
    p.add_argument("--tokenizer-from", type=Path, default=None,
                   help="with --model random:SHAPE: the directory whose tokenizer files it gets (default: SmolLM2's)")
    p.add_argument("--vocab-size", type=int, default=49152, help="with --model random:SHAPE")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bfloat16 on cuda, float32 on the CPU")
    p.add_argument("--task", default=None, help="default: reverse-text-long on cuda (heavy-tailed completion lengths up "
                   "to 1,024 tokens: the RL-shaped workload), reverse-text on the CPU, reverse with tiny-moe")
    p.add_argument("--ks", default="1,0", help="max_off_policy_steps of each run (the k = 0 run is async_speedup's peer)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="the model's sequence limit (default 128; 1,536 with --task reverse-text-long)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the steady-state figures")
    p.add_argument("--inference-nodes", type=int, default=1)
    p.add_argument("--batch-groups", type=int, default=None, help="prompts per step (default: 32 on cuda, 8 on the CPU)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=None,
                   help=f"the trainer's learning rate (default with a random: model {RANDOM_MODEL_LR} by the dtype, "
                        f"{PRETRAINED_LR:g} otherwise)")
    p.add_argument("--fp8", choices=["off", "experts", "all"], default="off")
    p.add_argument("--timeout", type=float, default=600, help="each run's hard limit in seconds")
    p.add_argument("--store-dir", type=Path, default=None,
                   help="the host's shared store under this directory (one per k; `sim --store-dir`), e.g. on tmpfs")
    p.add_argument("--store-payloads", type=Path, default=None,
                   help="the shared store's decoded payloads under this directory (one per k; `sim --store-payloads`), "
                        "e.g. on tmpfs: only wire shards reach the roles' disk")
    p.add_argument("--coordinator-state", type=Path, default=None,
                   help="the coordinator's state under this directory (one per k; `sim --coordinator-state`), e.g. "
                   "on tmpfs standing in for the coordinator's own machine where every role shares one disk")
    p.add_argument("--mps", action="store_true",
                   help="the roles share each GPU through NVIDIA's multi-process service (`sim --mps`)")
    p.add_argument("--master-float32", action="store_true",
                   help="the trainer keeps float32 weights and AdamW states and publishes in --dtype "
                        "(`join --master-float32`)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="the trainer's checkpoints (`join --checkpoint-every`; default 0: none, not even the last: the "
                        "steady state is the measure, and writing a 5.2B trainer's 30 GB took a minute of the GPU's "
                        "time after the last step)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--machine", default=None, help="recorded in the JSON (default: guessed)")
    p.add_argument("--no-engine-alone", dest="engine_alone", action="store_false",
                   help="skip the engine-alone run on the same workload (engine_alone_tok_s)")
    p.add_argument("--reread", type=Path, default=None, metavar="DIR",
                   help="run nothing: recompute the figures of a finished invocation's directory (its kK/ records)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.reread:
        return reread(args.reread)
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu_network-"))
    out.mkdir(parents=True, exist_ok=True)
    workload_defaults(args)
    real = args.model != "tiny-moe"
    model_run = model_of(args, out) if real else {}
    runs = []
    for k in [int(x) for x in args.ks.split(",")]:
        log.info("run k=%d: %s", k, place(args.device, args.inference_nodes).describe())
        runs.append(run_one(args, k, model_run, out / f"k{k}"))
        drop_stores(out / f"k{k}")
        public = {key: v for key, v in runs[-1].items() if not key.startswith("_")}
        log.info("k=%d: %s", k, json.dumps(public))
        (out / f"k{k}.json").write_text(json.dumps(public, indent=2))  # kept if a later run is cut short
    alone = engine_alone(args, model_run, out / "engine-alone") if args.engine_alone else {}
    log.info("engine alone: %s", alone)
    header = {
        "benchmark": "gpu_network", "machine": args.machine or _machine(), "model": args.model,
        "dtype": args.dtype, "model_params_b": _params_b(args, model_run), "task": args.task, "lr": args.lr,
        "master_dtype": "float32" if args.master_float32 else args.dtype,
        "inference_nodes": args.inference_nodes, "prompts_per_step": args.batch_groups, "group_size": args.group_size,
        "steps": args.steps, "warmup_steps": args.warmup,
        "coordinator_state": str(args.coordinator_state) if args.coordinator_state else "OUT/coordinator (the roles' disk)",
        "store_dir": str(args.store_dir) if args.store_dir else "OUT/shardcast (the roles' disk)",
        "store_payloads": str(args.store_payloads) if args.store_payloads else "beside the wire shards",
        "mps": args.mps,
    }
    report(out, summarise(header, runs, alone), runs)


def summarise(header: dict, runs: list[dict], alone: dict) -> dict:
    """The result: `header` (what ran, where), the largest k's figures against the engine alone (`alone`), the
    audits of every run, and each run's own figures."""
    last = max(runs, key=lambda r: r["k"])
    best = min(runs, key=lambda r: r["step_s"] or float("inf"))
    by_k = speedups(runs)
    return {
        **header,
        "step_s": last["step_s"], "weight_latency_s": last["weight_latency_s"],
        "async_speedup": by_k.get(last["k"]), "async_speedup_by_k": by_k,
        "gen_tok_s": last["gen_tok_s"], "verify_over_generate": last["verify_over_generate"],
        "gpu_busy_share": max((g["busy_share"] for g in last["gpus"].values()), default=None),
        "trained_tok_s": last["trained_tok_s"], **alone,
        "trained_over_engine_alone": round(last["trained_tok_s"] / alone["engine_alone_tok_s"], 3)
        if alone.get("engine_alone_tok_s") and last["trained_tok_s"] else None,
        **back_to_back(last, alone.get("engine_alone_tok_s")),
        "weight_latency_max_s": last["weight_latency_max_s"], "weight_latency_stages_s": last["weight_latency_stages_s"],
        "store_disk": last["store_disk"],
        "rollouts_rejected": sum(r["rollouts_rejected"] or 0 for r in runs),
        "honest_banned": sum(r["honest_banned"] or 0 for r in runs),
        "rollouts_lost": sum(r["rollouts_lost"] or 0 for r in runs),
        "rollouts_duplicated": sum(r["rollouts_duplicated"] or 0 for r in runs),
        "off_policy_violations": sum((r["max_off_policy_seen"] or 0) > r["k"] for r in runs),
        "fastest_k": best["k"], "load_avg": header.get("load_avg", os.getloadavg()[0]),
        "runs": [{key: v for key, v in r.items() if not key.startswith("_")} for r in runs],
    }


def back_to_back(run: dict, alone_tok_s: float | None) -> dict:
    """The network's rate if its roles' work on a trained token ran one after another: generating it at the engine
    alone's rate, judging it at the validator's rate while it worked in this run (its completion tokens per second of
    recomputation) and training on it at the trainer's (tokens per second of update). Those seconds are the roles'
    wall seconds, host work included (a validator round of 8 long-tailed claims at the 5.2B shape: 38 ms, 4.9 ms of
    it kernels; 1x H100, session 41), in which the other roles' kernels may run: `trained_over_back_to_back` above 1
    says the roles overlapped on the one GPU, below 1 that it stood idle while they waited on each other (the weight
    path, the verdicts, the publication)."""
    rates = (alone_tok_s, run.get("verify_completion_tok_s_busy"), run.get("train_tok_s_busy"))
    if not all(rates):
        return {"back_to_back_tok_s": None}
    rate = 1.0 / sum(1.0 / r for r in rates)
    return {"back_to_back_tok_s": round(rate, 1), "back_to_back_over_engine_alone": round(rate / rates[0], 3),
            "trained_over_back_to_back": round(run["trained_tok_s"] / rate, 3) if run.get("trained_tok_s") else None}


def report(out: Path, result: dict, runs: list[dict]) -> None:
    (out / "result.json").write_text(json.dumps(result, indent=2))
    plot(out / "report.png", runs, result)
    print(f"report: {out / 'report.png'}", flush=True)
    print(json.dumps(result))


_RUN_ONLY = ("k", "placement", "engine", "status", "wall_s", "store_disk", *_AUDIT)
"""A run's figures that its directory no longer holds once the run is over (the stores are dropped, the
processes gone): `reread` keeps them from the run's JSON."""


def reread(out: Path) -> None:
    """Each run's figures again from its records in `out` (a finished invocation's directory, as a device call
    brings it back: OUT/kK/ and OUT/kK.gpu.csv beside OUT/kK.json), by this code; what the records no longer hold
    (`_RUN_ONLY`, the engine alone, what ran where) is kept from the JSON files. The result says it was reread."""
    runs = []
    old = json.loads((out / "result.json").read_text()) if (out / "result.json").exists() else {}
    order = [r["k"] for r in old.get("runs", [])]  # as they ran (a run cut short has no row there: last)
    for path in sorted(out.glob("k*.json"), key=lambda p: order.index(int(p.stem[1:])) if int(p.stem[1:]) in order
                       else len(order)):
        before = json.loads(path.read_text())
        if not (out / path.stem / "trainer" / "metrics.jsonl").exists():
            raise SystemExit(f"{out / path.stem}: no trainer metrics to reread")
        warmup = old.get("warmup_steps", 2)
        run = {**before, **figures(out / path.stem, old.get("inference_nodes", 1), warmup, old.get("group_size", 8)),
               **{key: before.get(key) for key in _RUN_ONLY}}
        if not run["gpu_memory_gib_peak_by_role"]:  # no apps file came back: the run's own record
            run["gpu_memory_gib_peak_by_role"] = before.get("gpu_memory_gib_peak_by_role", {})
        runs.append(run)
    if not runs:
        raise SystemExit(f"{out}: no kK.json runs to reread")
    alone = {k: v for k, v in old.items() if k.startswith("engine_alone_")}
    header = {k: v for k, v in old.items() if k in ("benchmark", "machine", "model", "dtype", "model_params_b", "task",
                                                    "lr", "master_dtype", "inference_nodes", "prompts_per_step",
                                                    "group_size", "steps", "warmup_steps", "coordinator_state", "store_dir", "store_payloads",
                                                    "mps", "load_avg")}
    header["reread"] = "figures recomputed from the run's records by benchmarks.gpu_network --reread"
    report(out, summarise(header, runs, alone), runs)


def workload_defaults(args) -> None:
    """What `args` leaves unsaid, filled in place: on a GPU the issue's RL-shaped workload (>= 256 rollouts a step,
    the 8-layer 30B-A3B shape, the long-tailed task), on the CPU SmolLM2 learning `reverse-text`; the learning rate
    by the model and the trainer's master dtype (`RANDOM_MODEL_LR`, `PRETRAINED_LR`)."""
    gpu = args.device == "cuda"
    args.model = args.model or ("random:qwen3-30b-a3b-8l" if gpu else "smollm2-135m-instruct")
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    master = "float32" if getattr(args, "master_float32", False) else args.dtype
    args.lr = args.lr or (RANDOM_MODEL_LR.get(master, RANDOM_MODEL_LR["bfloat16"]) if args.model.startswith("random:")
                          else PRETRAINED_LR)
    args.batch_groups = args.batch_groups or (32 if gpu else 8)
    real = args.model != "tiny-moe"
    args.task = args.task or ("reverse" if not real else "reverse-text-long" if gpu else "reverse-text")


def model_of(args, out: Path) -> dict:
    """run_sim's model spec (weights hash pinned) for `--model`: a registry name, an HF directory,
    or `random:SHAPE` (benchmarks/random_checkpoint.py, written under OUT with `--tokenizer-from`'s tokenizer)."""
    from node.model_cli import pinned_model

    source = args.model
    # the long-tailed task's prompts hold its text and its completions run up to 1,024 tokens
    max_len = args.max_seq_len or (LONG_TASK_MAX_SEQ if args.task == "reverse-text-long" else PRETRAINED_MAX_SEQ)
    if source.startswith("random:"):
        from benchmarks.random_checkpoint import write_random

        tok = args.tokenizer_from
        if tok is None:
            from node.model.pretrained import smollm2_dir
            tok = smollm2_dir()
        t0 = time.time()
        source = str(write_random(source.removeprefix("random:"), out / "model", tok, args.vocab_size,
                                  max_seq_len=max_len, device="cuda:0" if args.device == "cuda" else "cpu",
                                  dtype=getattr(__import__("torch"), args.dtype)))
        log.info("random checkpoint written in %.1f s: %s", time.time() - t0, source)
    return {"model": pinned_model(source, args.dtype, max_len).model_dump()}


def _params_b(args, model_run: dict) -> float | None:
    try:
        from node.model.spec import model_config
        from node.model.qwen3_moe import CausalLM
        from protocol.model_spec import ModelSpec
        import torch

        cfg = model_config(ModelSpec(**model_run["model"])) if model_run.get("model") else None
        if cfg is None:
            return None
        with torch.device("meta"):
            m = CausalLM(cfg)
        return round(sum(p.numel() for p in m.parameters()) / 1e9, 4)
    except Exception:  # a figure for the record only
        return None


def _machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return f"cpu-{os.cpu_count()}core ({platform.machine()})"


if __name__ == "__main__":
    main()
