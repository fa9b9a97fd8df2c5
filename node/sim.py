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
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from node.sim_config import SimConfig, SimFlags
from node.sim_deadline import COORDINATOR_KILL_STEP, MEASURED, PROGRESS_EVERY, Deadline, plan, timeout_for
from node.sim_devices import place
from node.sim_network import Network, start_network, stop_network
from node.sim_procs import Proc, count_lines
from node.sim_report import REWARD_TARGET, plot_report, summarize
from node.version_trace import ROUNDS, judging_summary

log = logging.getLogger(__name__)


def run_sim(out: Path, cfg: SimConfig | None = None, **values) -> dict:
    """Run the network `cfg` describes (or `SimConfig(**values)`; node/sim_config.py says what each key
    does) in `out`: write run.toml and start the coordinator, then the members; watch until the run ends;
    stop every process and report. `timeout_s`: a hard limit; None: the limit follows the work
    (`timeout_for`, raised to the measured pace with a margin, and the run ends early only if no step
    finishes for `STALL_S`)."""
    cfg = cfg or SimConfig(**values)
    if cfg.inference_ep > 1:
        if any(d != "cpu" for d in (cfg.placement or place("cpu", cfg.inference_nodes)).inference):
            raise ValueError("sim --ep runs its expert-parallel inference nodes on the CPU (gloo) only")
        cfg = cfg.model_copy(update={"engine": "builtin-ep" if cfg.engine == "builtin" else cfg.engine})
    if cfg.vllm_nodes:
        check_vllm_nodes(cfg.inference_nodes, cfg.cheaters, cfg.vllm_nodes)
        # vLLM's CPU attention needs head_dim >= 32; the recipe's model has head_dim = hidden / 4.
        cfg = cfg.model_copy(update={"recipe": {"hidden": VLLM_MIN_HIDDEN, **(cfg.recipe or {})}})
    net = start_network(out, cfg)
    status, coordinator_restarted = watch(net)
    stop_network(net, status)
    return report(net, status, coordinator_restarted)


def watch(net: Network) -> tuple[str, bool]:
    """Until the run ends: churn, the reward target, progress lines. (status, coordinator restarted)."""
    cfg, procs, coord, t0 = net.cfg, net.members, net.coordinator, net.t0
    steps, rng = cfg.steps, random.Random(cfg.seed)
    deadline = Deadline(steps, timeout_for(steps, cfg.vllm_nodes) if cfg.timeout_s is None else cfg.timeout_s,
                        follow=cfg.timeout_s is None)
    metrics_path = net.out / "trainer" / "metrics.jsonl"
    churn_every = (10.0, 20.0) if steps < 60 else (20.0, 40.0)
    coordinator_restarted, next_churn, status = False, time.time() + churn_every[0], "timeout"
    reached_at, reported, checked, done_steps = None, 0, 0, 0
    members = {net.keys[n].peer_id for n in net.keys if n != "coordinator" and n not in net.cheaters}
    interrupted = []
    # Ctrl-C / SIGTERM end the run early but still stop every child (they run in their own sessions).
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, lambda *_: interrupted.append(1)) for sig in (signal.SIGTERM, signal.SIGINT)} \
        if main else {}
    while not interrupted:
        time.sleep(0.5)
        for proc in [coord, *procs.values()]:
            proc.sample_cpu()
        done_steps = count_lines(metrics_path)
        if (net.out / "trainer" / "done").exists():
            status = "done"
            break
        if not procs["trainer"].alive():
            status = "trainer exited"
            break
        failed = [p for name, p in procs.items() if name not in net.cheaters and p.p.poll() not in (None, 0)]
        if failed:  # an honest role that fails (an engine that cannot start, a bad device) is not waited out
            status = f"{failed[0].name} exited with code {failed[0].p.returncode}"
            log.error("%s; see %s", status, failed[0].log_path)
            break
        if cfg.stop_when is not None and cfg.stop_when(done_steps):
            status = "stopped"
            break
        ended = deadline.check(done_steps, time.time() - t0)
        if ended:
            status = ended
            log.error("giving up (%s) after %.0f s with %d steps done", ended, time.time() - t0, done_steps)
            break
        if cfg.churn and time.time() > next_churn:
            victim = procs[f"inference-{rng.randrange(cfg.inference_nodes)}"]
            log.info("churn: SIGKILL %s", victim.name)
            victim.kill()
            time.sleep(1.0)
            victim.start()
            next_churn = time.time() + rng.uniform(*churn_every)
        if cfg.stop_after_target is not None and done_steps != checked:
            checked = done_steps
            rewards = _rewards(metrics_path)
            if reached_at is None and len(rewards) >= 5 and sum(rewards[-5:]) / 5 >= REWARD_TARGET:
                reached_at = len(rewards)
                log.info("reward target %.2f reached at step %d; stopping %d steps later", REWARD_TARGET, reached_at,
                         cfg.stop_after_target)
            if reached_at is not None and done_steps >= reached_at + cfg.stop_after_target:
                status = "target reached"
                break
        # every VIEW_EVERY_S, and at each look until the view holds every member (a run of fast steps may end
        # within VIEW_EVERY_S of a view taken before its last member had joined)
        if time.time() - net.view_at[0] >= VIEW_EVERY_S or not all_alive(members, net.view_at[1]):
            look(net)
        if done_steps >= reported + PROGRESS_EVERY:
            reported = done_steps
            log.info("%s", progress_line(done_steps, steps, time.time() - t0, reached_at is not None,
                                         cfg.stop_after_target, os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0))
        if cfg.churn and not coordinator_restarted and done_steps >= max(2, min(steps // 3, COORDINATOR_KILL_STEP)):
            log.info("churn: SIGKILL coordinator at step %d", done_steps)
            coord.kill()
            time.sleep(1.0)
            coord.start()
            coordinator_restarted = True
    net.ended_at = time.time()
    # A member is alive at the end when a view counted it alive in the last RECENT_S of the run (members leave
    # when the run ends, so a view read after it lacks them: twice in sessions 26-27's CI a view read then named
    # every member that had just left). One not seen alive that recently (a node restarting after churn, members
    # rejoining a restarted coordinator) is waited for, every 0.5 s, at most VIEW_SETTLE_S.
    settle = time.time() + VIEW_SETTLE_S
    while not seen_alive_since(members, net.alive_seen, net.ended_at - RECENT_S) and time.time() < settle:
        time.sleep(0.5)
        look(net)
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    return status, coordinator_restarted


def report(net: Network, status: str, coordinator_restarted: bool) -> dict:
    """The run's audit from the coordinator's store and the trainer's log: DIR/metrics.jsonl,
    DIR/summary.json, DIR/report.png; returns the summary."""
    out, procs, coord, t0 = net.out, net.members, net.coordinator, net.t0
    wall = time.time() - t0
    exit_codes = {p.name: p.p.returncode for p in [coord, *procs.values()]}
    metrics_path = out / "trainer" / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    summary = summarize(out, rows, net.run_toml, net.keys, net.cheaters, wall, status, t0)
    summary["coordinator_restarts"] = int(coordinator_restarted)
    summary["inference_kills"] = sum(what == "kill" for p in procs.values() for _, what in p.events)
    summary["exit_codes"] = exit_codes
    # every role's CPU seconds (all its incarnations; read from /proc while it ran): benchmarks.step_time
    # divides them by the steps to say where the machine's cores went
    summary["cpu_s"] = {p.name: round(p.cpu_s, 1) for p in [coord, *procs.values()]}
    judged = out / "validator" / ROUNDS  # the validator's rounds (sim traces every member): what its slowest was
    if judged.exists():
        summary.update(judging_summary([json.loads(x) for x in judged.read_text().splitlines() if x.strip()]))
    restarts = [t for t, what in coord.events if what == "start"][1:]
    late = bool(restarts) and net.ended_at - restarts[-1] < VIEW_SETTLE_S
    summary.update(membership_at_end(out, net.keys, net.cheaters, net.view_at, procs, net.ended_at, net.alive_seen,
                                     restarted_before_end=late))
    with (out / "metrics.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps({k: v for k, v in r.items() if k != "work_ids"}) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    # each process's starts, SIGKILLs and stops (Unix seconds): benchmarks.step_time times restarts with them
    (out / "events.json").write_text(json.dumps({"t0": t0, **{p.name: p.events for p in [coord, *procs.values()]}}))
    plot_report(out / "report.png", rows, {p.name: p.events for p in [coord, *procs.values()]}, t0, summary)
    return summary


def check_vllm_nodes(inference_nodes: int, cheaters: int, vllm_nodes: int) -> None:
    if vllm_nodes > inference_nodes - cheaters:
        raise ValueError("--vllm-nodes counts honest inference nodes: at most --inference-nodes minus --cheaters")
    if not os.environ.get("PRIMERL_VLLM_PYTHON"):
        raise ValueError("--vllm-nodes needs PRIMERL_VLLM_PYTHON (the python of vLLM's own environment)")


def progress_line(done: int, steps: int, elapsed: float, reached: bool, stop_after: int | None, load: float) -> str:
    """How the run goes, from its own pace so far (it follows a machine that slows down): the time to the
    step limit, and to the target if it comes at the step the committed run reached it."""
    rate = elapsed / done
    line = f"step {done} of at most {steps}: {rate:.1f} s/step so far (load average {load:.0f})"
    if reached:
        return line + "; reward target reached"
    left = f"~{(steps - done) * rate / 60:.0f} min to step {steps} at this pace"
    at = MEASURED["target_step"] + (stop_after or 0)
    if stop_after is not None and done < at:
        left = f"~{(at - done) * rate / 60:.0f} min to the end if the target comes at step ~{MEASURED['target_step']} " \
               f"as measured, {left}"
    return f"{line}; {left}"


VIEW_EVERY_S = 5.0
"""How often the sim reads the coordinator's membership view (its status page) for `membership_at_end`."""
VIEW_SETTLE_S = 15.0
"""How long the end of a run waits for a membership view to count every member alive (rejoins after a restart)."""
RECENT_S = 2 * VIEW_EVERY_S
"""A member counted alive by a view this long before the run ended (or after) was alive at its end."""


def all_alive(members: set[str], view: dict[str, str]) -> bool:
    """Whether the coordinator's `view` (peer id -> state) counts every one of `members` alive."""
    return all(view.get(p) == "alive" for p in members)


def seen_alive_since(members: set[str], alive_seen: dict[str, float], since: float) -> bool:
    """Whether a membership view counted every one of `members` alive at `since` or later."""
    return all(alive_seen.get(p, 0.0) >= since for p in members)


def look(net: Network) -> None:
    """Read the coordinator's membership view now, kept with its time, and note who it counts alive; an
    unreachable coordinator (restarting) leaves the last view as it was, with its own time."""
    view = _membership_view(net.run_toml["status_port"])
    if view is None:
        return
    now = time.time()
    net.view_at = (now, view)
    for peer, state in view.items():
        if state == "alive":
            net.alive_seen[peer] = now


def _membership_view(port: int) -> dict[str, str] | None:
    """Peer id -> state ("alive", "unhealthy", "dead") in the coordinator's view now, or None if unreachable."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json", timeout=2) as r:
            return {m["peer_id"]: m["state"] for m in json.loads(r.read())["members"]}
    except (OSError, ValueError, KeyError):
        return None


def membership_at_end(out: Path, keys: dict, cheater_names: list[str], view_at: tuple[float, dict[str, str]],
                      procs: dict[str, Proc], ended_at: float, alive_seen: dict[str, float],
                      restarted_before_end: bool = False) -> dict:
    """Honest members not alive at the end of the run: those no membership view counted alive in the run's last
    `RECENT_S` or after (`alive_seen`: peer id -> the last time a view did; views are read every `VIEW_EVERY_S`
    until the run ended at `ended_at`, then until every member is seen alive or `VIEW_SETTLE_S` more passed, the
    last of them `view_at`). An inference node SIGKILLed in the 15 s before the last view, or before the run ended,
    is excused: it is restarting, and a run that has ended takes no joins (a churn kill 8 s before the end named a
    node in session 27's CI). With `restarted_before_end`, the run ended too soon after a coordinator restart to
    judge anyone: they are listed as not rejoined instead. Also how often the coordinator's log ejected each as
    dead (churn's SIGKILLs eject inference nodes, as they should)."""
    at, view = view_at
    killed = {name for name, p in procs.items()
              if any(w == "kill" and min(at, ended_at) - 15 <= t <= at for t, w in p.events)}
    honest = [n for n in keys if n != "coordinator" and n not in cheater_names]
    missing = sorted(n for n in honest if alive_seen.get(keys[n].peer_id, 0.0) < ended_at - RECENT_S
                     and n not in killed)
    log_text = (out / "coordinator" / "log.txt").read_text(errors="replace") if view else ""
    ejected = {n: c for n in honest if (c := sum("dead, ejected" in line and keys[n].peer_id in line
                                                   for line in log_text.splitlines()))}
    if restarted_before_end:
        # the run ended within VIEW_SETTLE_S of a coordinator restart (steps queued before it ran in seconds): its
        # members left at the end before they had joined the new coordinator, so its view says nothing of them
        return {"honest_not_alive_at_end": [], "honest_not_rejoined_before_end": missing, "honest_ejections": ejected}
    return {"honest_not_alive_at_end": missing, "honest_ejections": ejected}


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
    from node.config_flags import add_flags

    p = sub.add_parser("sim", help="the whole network on this machine, one OS process per role",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, SimFlags)
    p.set_defaults(func=_main)


def pretrained_run(source: str | None) -> dict:
    """run_sim's model for `--model`: a real checkpoint gets its weights hash pinned in the spec (every
    member checks version 0 against it); its recipe has no warm-up (`Recipe.for_model`)."""
    if source is None or source == "tiny-moe":
        return {}
    from node.model_cli import pinned_model

    # float32, asked for: the sim's CPU engines then agree bit for bit with the validator's prefill
    return {"model": pinned_model(source, "float32", PRETRAINED_MAX_SEQ).model_dump()}


PRETRAINED_MAX_SEQ = 128
"""Sequence limit of a sim on a real model (chat prompt ~40 tokens + the tasks' <= 48 new tokens)."""


def _main(args: argparse.Namespace) -> int:
    from node.config_flags import config_from

    flags = config_from(SimFlags, args)
    if flags.cheaters > flags.inference_nodes:
        raise SystemExit("--cheaters cannot exceed --inference-nodes")
    if flags.vllm_nodes:
        try:
            check_vllm_nodes(flags.inference_nodes, flags.cheaters, flags.vllm_nodes)
        except ValueError as exc:
            raise SystemExit(f"primerl-node sim: {exc}") from None
    stop_after = None if flags.stop_after_target < 0 else flags.stop_after_target
    timeout = timeout_for(flags.steps, flags.vllm_nodes) if flags.timeout_s is None else flags.timeout_s
    print(plan(flags.steps, stop_after, timeout), flush=True)
    cfg = SimConfig(**{**flags.model_dump(exclude=set(SimFlags.model_fields) - set(SimConfig.model_fields)),
                       "stop_after_target": stop_after, "placement": place(flags.device, flags.inference_nodes),
                       "engine": flags.engine or ("builtin-cuda" if flags.device == "cuda" else "builtin"),
                       **pretrained_run(flags.model_name)})
    summary = run_sim(flags.out, cfg)
    print(json.dumps(summary))
    print(f"report: {flags.out / 'report.png'}")
    return 0 if summary["status"] in ("done", "target reached") else 1
