"""`primerl-node sim`: the whole network on one machine, every role its own OS process.

A coordinator, a trainer, a validator, a relay and N inference nodes on 127.0.0.1 (real libp2p,
real HTTP). `--churn` SIGKILLs and restarts inference nodes during the run, and the coordinator
once; `--cheaters K` runs K inference nodes as cheaters (node/adversary.py); `--vllm-nodes K` runs K
of them on vLLM (`join --engine vllm`; needs $PRIMERL_VLLM_PYTHON) and makes the run accept vLLM
rollouts. It ends `--stop-after-target` steps after the reward target, or after `--steps`, and gives
up after a timeout that follows the work (start-up + a per-step allowance); it says at the start
how long it should take. At the end it computes, from the
coordinator's durable store and the trainer's per-step log (never assumed):
`rollouts_lost` (accepted but unreadable from the store, or batched by the coordinator but never
trained on) and `rollouts_duplicated` (trained on in more than one step), and writes
DIR/metrics.jsonl, DIR/summary.json, DIR/report.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from node.adversary import CHEATS
from node.sim_procs import Proc, count_lines, free_port, wait_for
from node.recipe import DEFAULT as DEFAULT_RECIPE
from node.sim_deadline import (COORDINATOR_KILL_STEP, PROGRESS_EVERY, STALL_S, START_ALLOWANCE_S, STEP_ALLOWANCE_S,
                               STOP_AFTER_TARGET, VLLM_START_S, Deadline, plan, timeout_for)
from node.sim_devices import Placement, place
from node.sim_report import REWARD_TARGET, plot_report, summarize
from node.run_config import RunConfig, to_toml
from protocol.identity import NodeKey

log = logging.getLogger(__name__)


_RUN = RunConfig.model_fields
"""Run defaults come from run.toml's (node/run_config.py), recipe defaults from node/recipe.py."""


def trainer_launcher(layout: str | None) -> tuple[list[str], list[str]]:
    """torchrun's arguments and the join flags for a trainer layout such as 'dp2-ep2' (None: one process)."""
    if not layout:
        return [], []
    from node.rl.parallel.launch import parse_layout

    dims = parse_layout(layout)
    return (["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={dims.world}"],
            ["--dp", str(dims.dp), "--ep", str(dims.ep), "--cp", str(dims.cp)])


def run_sim(out: Path, inference_nodes: int = 4, steps: int = DEFAULT_RECIPE.steps, task: str = "reverse",
            churn: bool = False, cheaters: int = 0, max_off_policy_steps: int = _RUN["max_off_policy_steps"].default,
            seed: int = 0, batch_groups: int = _RUN["batch_groups"].default,
            group_size: int = _RUN["group_size"].default, timeout_s: float | None = None, recipe: dict | None = None,
            vllm_nodes: int = 0, trainer_parallel: str | None = None, stop_after_target: int | None = None,
            model: dict | None = None, run: dict | None = None, placement: Placement | None = None,
            engine: str = "builtin", fp8: str = "off", inference_ep: int = 1,
            stop_when: Callable[[int], bool] | None = None) -> dict:
    """Run the network. `timeout_s`: a hard limit; None: the limit follows the work (`timeout_for`, raised to
    the measured pace with a margin, and the run ends early only if no step finishes for `STALL_S`).
    `stop_after_target`: end the run this many steps after the reward target (None: train all `steps`).
    `model`: the run's model spec (None: the tiny MoE); `run`: run.toml keys to override (e.g. a longer
    dead_after_missed for a large model on a busy machine). `placement`: each role's `--device`
    (node/sim_devices.py; None: all on the CPU); `engine`: the honest inference nodes' `--engine` (vLLM nodes
    excepted); `fp8`: the run spec's `model.fp8` (every inference node serves it, the validator recomputes in it;
    docs/fp8.md); `inference_ep`: each honest built-in inference node serves over this many
    expert-parallel processes (`join --ep`, engine builtin-ep; CPU only here). `stop_when`: called with the
    steps done at each poll; True ends the run there, every role stopped as at a timeout (status "stopped";
    tests stop on progress, not after a fixed time)."""
    placement = placement or place("cpu", inference_nodes)
    if inference_ep > 1:
        if any(d != "cpu" for d in placement.inference):
            raise ValueError("sim --ep runs its expert-parallel inference nodes on the CPU (gloo) only")
        engine = "builtin-ep" if engine == "builtin" else engine
    deadline = Deadline(steps, timeout_for(steps, vllm_nodes) if timeout_s is None else timeout_s,
                        follow=timeout_s is None)
    if vllm_nodes:
        check_vllm_nodes(inference_nodes, cheaters, vllm_nodes)
        # vLLM's CPU attention needs head_dim >= 32; the recipe's model has head_dim = hidden / 4.
        recipe = {"hidden": VLLM_MIN_HIDDEN, **(recipe or {})}
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    keys = {name: NodeKey.generate() for name in ["coordinator", "trainer", "validator", "relay",
                                                  *[f"inference-{i}" for i in range(inference_nodes)]]}
    for name, key in keys.items():
        (out / name).mkdir(exist_ok=True)
        key.save(out / name / "node.key")
    origin, relay_port = free_port(), free_port()
    run_id = re.sub(r"[^A-Za-z0-9._-]", "-", f"sim-{task}-{seed}")[:64]  # a run id is [A-Za-z0-9._-]; task names may hold ':'
    cfg = {"run_id": run_id, "task": task, "batch_groups": batch_groups, "group_size": group_size,
           "max_off_policy_steps": max_off_policy_steps, "verification_rate": 1.0, "heartbeat_interval_s": 2.0,
           "dead_after_missed": 3, "lease_ttl_s": 60.0,
           "shardcast_sources": [f"http://127.0.0.1:{origin}", f"http://127.0.0.1:{relay_port}"],
           "trainer": keys["trainer"].peer_id, "validators": [keys["validator"].peer_id],
           "listen": f"/ip4/127.0.0.1/tcp/{free_port()}", "status_port": free_port(),
           "recipe": {"steps": steps, "seed": seed, **(recipe or {})}}
    if vllm_nodes:
        cfg["engines"] = ["builtin", "vllm"]
    if model:  # a [model] table (protocol/model_spec.py); the default is the recipe-shaped tiny MoE
        cfg["model"] = model
    if fp8 != "off":  # the run serves FP8: nodes follow the spec (no --fp8 flag), the validator recomputes so
        cfg["model"] = {**cfg.get("model", {}), "fp8": fp8}
    cfg.update(run or {})
    (out / "run.toml").write_text(to_toml(cfg))
    addr_file = out / "coordinator" / "addr"
    coord = Proc("coordinator", ["coordinator", "launch", "--config", str(out / "run.toml"), "--state",
                                 str(out / "coordinator"), "--key", str(out / "coordinator" / "node.key"),
                                 "--addr-file", str(addr_file),
                                 # the audit at the end reads every accepted unit: nothing may be pruned
                                 "--retain-versions", str(steps + 1)], out / "coordinator" / "log.txt")
    t0 = time.time()
    coord.start()
    bootstrap = wait_for(addr_file, coord, 60).splitlines()[0]
    spec = str(out / "coordinator" / "spec.json")
    cheater_names = [f"inference-{i}" for i in range(inference_nodes - cheaters, inference_nodes)]
    kinds = list(CHEATS)

    def member(name: str, role: str, extra: list[str] = (), launcher: list[str] = ()) -> Proc:
        argv = ["join", "--role", role, "--bootstrap", bootstrap, "--spec", spec, "--key",
                str(out / name / "node.key"), "--workdir", str(out / name), *extra]
        if name in cheater_names:  # the adversary's program: an inference node with its cheating hook
            return Proc(name, ["--cheat", kinds[cheater_names.index(name) % len(kinds)], *argv],
                        out / name / "log.txt", module="node.adversary")
        return Proc(name, argv, out / name / "log.txt", launcher)
    launcher, parallel_flags = trainer_launcher(trainer_parallel)
    procs = {"trainer": member("trainer", "trainer", ["--shardcast-port", str(origin), *parallel_flags,
                                                      "--device", placement.trainer], launcher),
             "validator": member("validator", "validator", ["--device", placement.validator, "--trace-versions"]),
             "relay": member("relay", "relay", ["--shardcast-port", str(relay_port)])}
    for i in range(inference_nodes):
        name = f"inference-{i}"
        extra = ["--engine", "vllm"] if i < vllm_nodes else \
            ["--engine", engine, "--device", placement.inference[i],
             *(["--ep", str(inference_ep)] if inference_ep > 1 else [])]
        procs[name] = member(name, "inference", [*extra, "--trace-versions"])  # versions.jsonl: weight latency
    vllm_procs = [procs[f"inference-{i}"] for i in range(vllm_nodes)]
    for p in vllm_procs:  # first, so vLLM's start-up (tens of seconds) ends before the first policy
        p.start()
    try:
        for p in vllm_procs:
            wait_for(out / p.name / "engine.ready", p, VLLM_START_S)
    except (RuntimeError, TimeoutError):
        for p in [*vllm_procs, coord]:
            p.stop()
        raise
    for p in procs.values():
        if p not in vllm_procs:
            p.start()
    metrics_path = out / "trainer" / "metrics.jsonl"
    churn_every = (10.0, 20.0) if steps < 60 else (20.0, 40.0)
    coordinator_restarted, next_churn, status = False, time.time() + churn_every[0], "timeout"
    reached_at, reported, checked, done_steps = None, 0, 0, 0
    interrupted = []
    # Ctrl-C / SIGTERM end the run early but still stop every child (they run in their own sessions).
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, lambda *_: interrupted.append(1)) for sig in (signal.SIGTERM, signal.SIGINT)} \
        if main else {}
    while not interrupted:
        time.sleep(0.5)
        done_steps = count_lines(metrics_path)
        if (out / "trainer" / "done").exists():
            status = "done"
            break
        if not procs["trainer"].alive():
            status = "trainer exited"
            break
        failed = [p for name, p in procs.items() if name not in cheater_names and p.p.poll() not in (None, 0)]
        if failed:  # an honest role that fails (an engine that cannot start, a bad device) is not waited out
            status = f"{failed[0].name} exited with code {failed[0].p.returncode}"
            log.error("%s; see %s", status, failed[0].log_path)
            break
        if stop_when is not None and stop_when(done_steps):
            status = "stopped"
            break
        ended = deadline.check(done_steps, time.time() - t0)
        if ended:
            status = ended
            log.error("giving up (%s) after %.0f s with %d steps done", ended, time.time() - t0, done_steps)
            break
        if churn and time.time() > next_churn:
            victim = procs[f"inference-{rng.randrange(inference_nodes)}"]
            log.info("churn: SIGKILL %s", victim.name)
            victim.kill()
            time.sleep(1.0)
            victim.start()
            next_churn = time.time() + rng.uniform(*churn_every)
        if stop_after_target is not None and done_steps != checked:
            checked = done_steps
            rewards = _rewards(metrics_path)
            if reached_at is None and len(rewards) >= 5 and sum(rewards[-5:]) / 5 >= REWARD_TARGET:
                reached_at = len(rewards)
                log.info("reward target %.2f reached at step %d; stopping %d steps later", REWARD_TARGET, reached_at,
                         stop_after_target)
            if reached_at is not None and done_steps >= reached_at + stop_after_target:
                status = "target reached"
                break
        if done_steps >= reported + PROGRESS_EVERY:
            reported = done_steps
            rate = (time.time() - t0) / done_steps
            log.info("step %d of at most %d: %.1f s/step so far; %s", done_steps, steps, rate,
                     "reward target reached" if reached_at else
                     f"at most {(steps - done_steps) * rate / 60:.0f} min to go")
        if churn and not coordinator_restarted and done_steps >= max(2, min(steps // 3, COORDINATOR_KILL_STEP)):
            log.info("churn: SIGKILL coordinator at step %d", done_steps)
            coord.kill()
            time.sleep(1.0)
            coord.start()
            coordinator_restarted = True
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    if status == "done":  # the trainer exits by itself once done, and the coordinator then ends the run for
        # every member (exit 0 each, the coordinator after its grace): a SIGTERM now would race their exits
        end = time.time() + 30
        for p in [procs["trainer"], *procs.values(), coord]:
            try:
                if p.p is not None:
                    p.p.wait(max(0.1, end - time.time()))
            except subprocess.TimeoutExpired:
                pass
    for p in procs.values():
        p.stop()
    coord.stop()
    wall = time.time() - t0
    exit_codes = {p.name: p.p.returncode for p in [coord, *procs.values()]}
    rows = [json.loads(x) for x in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    summary = summarize(out, rows, cfg, keys, cheater_names, wall, status, t0)
    summary["coordinator_restarts"] = int(coordinator_restarted)
    summary["inference_kills"] = sum(what == "kill" for p in procs.values() for _, what in p.events)
    summary["exit_codes"] = exit_codes
    with (out / "metrics.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps({k: v for k, v in r.items() if k != "work_ids"}) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_report(out / "report.png", rows, {p.name: p.events for p in [coord, *procs.values()]}, t0, summary)
    return summary


def check_vllm_nodes(inference_nodes: int, cheaters: int, vllm_nodes: int) -> None:
    if vllm_nodes > inference_nodes - cheaters:
        raise ValueError("--vllm-nodes counts honest inference nodes: at most --inference-nodes minus --cheaters")
    if not os.environ.get("PRIMERL_VLLM_PYTHON"):
        raise ValueError("--vllm-nodes needs PRIMERL_VLLM_PYTHON (the python of vLLM's own environment)")


VLLM_MIN_HIDDEN = 128
"""Model width of a sim with vLLM nodes unless the recipe says otherwise (head_dim 32: vLLM CPU's least)."""

def _rewards(path: Path) -> list[float]:
    """Each finished step's mean reward, from the trainer's metrics (a line being written is skipped)."""
    out = []
    try:
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line)["reward_mean"])
            except (ValueError, KeyError):
                break
    except OSError:
        pass
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="the whole network on this machine, one OS process per role",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inference-nodes", type=int, default=4)
    p.add_argument("--steps", type=int, default=DEFAULT_RECIPE.steps, help="trainer steps")
    p.add_argument("--task", default="reverse")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--churn", action="store_true", help="SIGKILL/restart inference nodes, and the coordinator once")
    p.add_argument("--cheaters", type=int, default=0, help="inference nodes that tamper with their work")
    p.add_argument("--vllm-nodes", type=int, default=0,
                   help="inference nodes on vLLM (join --engine vllm; needs PRIMERL_VLLM_PYTHON)")
    p.add_argument("--max-off-policy-steps", type=int, default=_RUN["max_off_policy_steps"].default)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-groups", type=int, default=_RUN["batch_groups"].default, help="prompts per trainer step")
    p.add_argument("--group-size", type=int, default=_RUN["group_size"].default, help="samples per prompt")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"a hard limit in seconds (default: {START_ALLOWANCE_S:.0f} s + {STEP_ALLOWANCE_S:.0f} s per step, "
                        "+ vLLM's start-up, raised to the measured pace; the run also ends when no step finishes "
                        f"for {STALL_S:.0f} s)")
    p.add_argument("--stop-after-target", type=int, default=STOP_AFTER_TARGET, metavar="N",
                   help=f"end N steps after the 5-step mean reward reaches {REWARD_TARGET} (-1: train all --steps)")
    p.add_argument("--trainer-parallel", metavar="LAYOUT", default=None,
                   help="run the trainer as torchrun ranks (gloo on CPU), e.g. dp2-ep2, cp2, dp2-ep2-cp2")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: trainer on GPU 0, inference nodes on the other GPUs, validator on the last "
                        "(node/sim_devices.py); coordinator and relay on the CPU")
    p.add_argument("--engine", default=None,
                   help="the inference nodes' engine (default: builtin on the CPU, builtin-cuda with --device cuda)")
    p.add_argument("--fp8", choices=["off", "experts", "all"], default="off",
                   help="the run serves FP8 (spec model.fp8): every built-in inference node serves block-scaled e4m3 "
                        "weights (builtin on the CPU, builtin-cuda with --device cuda) and the validator recomputes "
                        "with the same quantisation and FP8 thresholds (docs/fp8.md)")
    p.add_argument("--ep", type=int, default=1, metavar="N",
                   help="each built-in inference node serves over N expert-parallel processes (join --ep N, engine "
                        "builtin-ep, gloo on the CPU); N must divide the recipe's experts")
    p.add_argument("--model", default=None,
                   help="the run's model: tiny-moe (default), smollm2-135m-instruct, or an HF-layout directory")
    p.set_defaults(func=_main)


def pretrained_run(source: str | None) -> dict:
    """run_sim's model and recipe for `--model`: a real checkpoint gets its weights hash pinned in the
    spec (every member checks version 0 against it) and no supervised warm-up (it is pretrained)."""
    if source is None or source == "tiny-moe":
        return {}
    from node.model.spec import load_model
    from protocol.model_spec import ModelSpec

    spec = ModelSpec(source=source, max_seq_len=PRETRAINED_MAX_SEQ)
    return {"model": {**spec.model_dump(), "weights_hash": load_model(spec).weights_hash},
            "recipe": {"warmup_target": 0.0}}


PRETRAINED_MAX_SEQ = 128
"""Sequence limit of a sim on a real model (chat prompt ~40 tokens + the tasks' <= 48 new tokens)."""


def _main(args: argparse.Namespace) -> int:
    if args.cheaters > args.inference_nodes:
        raise SystemExit("--cheaters cannot exceed --inference-nodes")
    if args.vllm_nodes:
        try:
            check_vllm_nodes(args.inference_nodes, args.cheaters, args.vllm_nodes)
        except ValueError as exc:
            raise SystemExit(f"primerl-node sim: {exc}") from None
    stop_after = None if args.stop_after_target < 0 else args.stop_after_target
    timeout = timeout_for(args.steps, args.vllm_nodes) if args.timeout is None else args.timeout
    print(plan(args.steps, stop_after, timeout), flush=True)
    summary = run_sim(args.out, args.inference_nodes, args.steps, args.task, args.churn, args.cheaters,
                      args.max_off_policy_steps, args.seed, args.batch_groups, args.group_size, args.timeout,
                      vllm_nodes=args.vllm_nodes, trainer_parallel=args.trainer_parallel, stop_after_target=stop_after,
                      placement=place(args.device, args.inference_nodes),
                      engine=args.engine or ("builtin-cuda" if args.device == "cuda" else "builtin"), fp8=args.fp8,
                      inference_ep=args.ep,
                      **pretrained_run(args.model))
    print(json.dumps(summary))
    print(f"report: {args.out / 'report.png'}")
    return 0 if summary["status"] in ("done", "target reached") else 1
