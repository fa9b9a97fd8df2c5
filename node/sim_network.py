"""The processes of one simulated run: run.toml on free ports of 127.0.0.1, the coordinator, then every
member as `primerl-node join` (cheaters as node/adversary.py, a parallel trainer under torchrun), and
their stop: members that end by themselves once the run is done are let go before any signal."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from node.adversary import CHEATS
from node.run_config import to_toml
from node.sim_config import SimConfig
from node.sim_deadline import VLLM_START_S
from node.sim_devices import place
from node.sim_mps import Mps
from node.sim_procs import Proc, free_port, wait_for
from protocol.identity import NodeKey

log = logging.getLogger(__name__)


def trainer_launcher(layout: str | None) -> tuple[list[str], list[str]]:
    """torchrun's arguments and the join flags for a trainer layout such as 'dp2-ep2' (None: one process)."""
    if not layout:
        return [], []
    from node.rl.parallel.dims import parse_layout

    dims = parse_layout(layout)
    return (["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={dims.world}"],
            ["--dp", str(dims.dp), "--ep", str(dims.ep), "--cp", str(dims.cp)])


def plan_network_memory(run_toml: Path, coordinator: str, cfg: SimConfig, placement) -> None:
    """Every role's memory plan on the device the sim puts it on, summed where roles share one, printed;
    `MemoryPlanDoesNotFit` (one line, exit 2) before any process starts when a device cannot hold its roles."""
    from node.roles.memory import role_plan, shared_device_plans
    from node.run_config import RunConfig

    spec = RunConfig.load(run_toml).run_spec(coordinator)
    parallel, ranks = None, 1
    if cfg.trainer_parallel:
        from node.rl.parallel.dims import parse_layout
        dims = parse_layout(cfg.trainer_parallel)
        parallel, ranks = {"dp": dims.dp, "cp": dims.cp, "fsdp": dims.fsdp}, dims.world
    free = gpu_free({placement.trainer, placement.validator, *placement.inference} - {"cpu"})
    roles = [*[("trainer", placement.trainer, {"parallel": parallel})] * ranks,  # a trainer's ranks share its device
             ("validator", placement.validator, {}),
             *[("inference", placement.inference[i], {"engine": cfg.engine})
               for i in range(cfg.vllm_nodes, cfg.inference_nodes)]]
    # a GPU that did not answer is not planned here: the role placed on it says what is wrong when it starts
    plans = [role_plan(spec, role, device, free.get(device), **kw) for role, device, kw in roles
             if device == "cpu" or device in free]
    for plan in shared_device_plans([p for p in plans if p is not None]):
        print(plan.describe(), flush=True)
        plan.check()


def gpu_free(devices: set[str]) -> dict[str, int]:
    """Free memory of each `cuda:I`, asked by a short child process: asking here would give the sim's own
    process a CUDA context (hundreds of MiB of the GPU the roles share) for the whole run."""
    if not devices:
        return {}
    order = sorted(devices)
    code = ("import sys, torch; print(' '.join(str(torch.cuda.mem_get_info(int(d.split(':')[1]))[0]) "
            "for d in sys.argv[1:]))")
    try:
        out = subprocess.run([sys.executable, "-c", code, *order], capture_output=True, text=True, timeout=120, check=True)
        return dict(zip(order, map(int, out.stdout.split())))
    except (subprocess.SubprocessError, ValueError) as exc:  # no CUDA here, or no such GPU
        tail = (getattr(exc, "stderr", None) or str(exc)).strip().splitlines()[-1:]
        log.warning("memory plan: could not ask %s for free memory (%s); not planned here", ", ".join(order),
                    tail[0] if tail else exc)
        return {}


@dataclass
class Network:
    """The processes of one simulated run and what they were started with."""

    out: Path
    cfg: SimConfig
    run_toml: dict
    """run.toml's values, as the coordinator was launched with them."""
    keys: dict[str, NodeKey]
    coordinator: Proc
    members: dict[str, Proc]
    cheaters: list[str]
    t0: float
    view_at: tuple[float, dict[str, str]] = (0.0, {})
    """When the sim last read the coordinator's membership view, and that view (peer id -> state)."""
    alive_seen: dict[str, float] = field(default_factory=dict)
    """Peer id -> the last time a membership view counted it alive (`node.sim.look`)."""
    ended_at: float = 0.0
    """When the sim's loop ended (the run's last step, or its stop): the membership audit's reference."""
    mps: Mps | None = None
    """The multi-process service daemon the roles on GPUs share (`SimConfig.mps`), stopped after them."""


def store_of(out: Path, name: str) -> Path:
    """The shardcast store member `name` of a sim in `out` used: the host's shared one, else its own."""
    shared = out / "shardcast"
    return shared if shared.is_dir() else out / name / "shardcast"


def write_run_toml(out: Path, cfg: SimConfig, keys: dict[str, NodeKey], origin: int, relay_port: int) -> dict:
    """The run as its coordinator's operator would write it, on free ports of 127.0.0.1 (`origin`: the
    trainer's shardcast port, `relay_port` the relay's)."""
    run_id = re.sub(r"[^A-Za-z0-9._-]", "-", f"sim-{cfg.task}-{cfg.seed}")[:64]  # task names may hold ':'
    run = {"run_id": run_id, "task": cfg.task, "batch_groups": cfg.batch_groups, "group_size": cfg.group_size,
           "max_off_policy_steps": cfg.max_off_policy_steps, "verification_rate": 1.0, "heartbeat_interval_s": 2.0,
           "dead_after_missed": 3, "lease_ttl_s": 60.0,
           "shardcast_sources": [f"http://127.0.0.1:{origin}", f"http://127.0.0.1:{relay_port}"],
           "trainer": keys["trainer"].peer_id, "validators": [keys["validator"].peer_id],
           "listen": f"/ip4/127.0.0.1/tcp/{free_port()}", "status_port": free_port(),
           "recipe": {"steps": cfg.steps, "seed": cfg.seed, **(cfg.recipe or {})}}
    if cfg.vllm_nodes:
        run["engines"] = ["builtin", "vllm"]
    if cfg.model:  # a [model] table (protocol/model_spec.py); the default is the recipe-shaped tiny MoE
        run["model"] = cfg.model
    if cfg.fp8 != "off":  # the run serves FP8: nodes follow the spec (no --fp8 flag), the validator recomputes so
        run["model"] = {**run.get("model", {}), "fp8": cfg.fp8}
    run.update(cfg.run or {})
    (out / "run.toml").write_text(to_toml(run))
    return run


def link_elsewhere(out: Path, name: str, target: Path) -> None:
    """OUT/`name` as a link to `target` (made if missing), so every path the sim reads stays the same; an OUT/`name`
    that is already that link is kept, anything else there is refused (what it holds would be lost)."""
    target = Path(target).resolve()
    target.mkdir(parents=True, exist_ok=True)
    link = out / name
    if link.is_symlink() and link.resolve() == target:
        return
    if link.exists() or link.is_symlink():
        raise FileExistsError(f"{link} exists: it cannot also be {target}")
    link.symlink_to(target, target_is_directory=True)


def start_network(out: Path, cfg: SimConfig) -> Network:
    """Keys, run.toml, the coordinator, then every member (vLLM nodes first: their start-up is long); with
    `cfg.mps`, the multi-process service's daemon before them all."""
    placement = cfg.placement or place("cpu", cfg.inference_nodes)
    if not cfg.mps:
        return _start_network(out, cfg, placement, None)
    if not any(d.startswith("cuda") for d in (placement.trainer, placement.validator, *placement.inference)):
        raise ValueError("sim --mps shares GPUs between the roles: it needs roles on a GPU (--device cuda)")
    mps = Mps.start()
    try:
        return _start_network(out, cfg, placement, mps)
    except BaseException:
        mps.stop(out / "mps-log")
        raise


def _start_network(out: Path, cfg: SimConfig, placement, mps: Mps | None) -> Network:  # noqa: ANN001
    out.mkdir(parents=True, exist_ok=True)
    keys = {name: NodeKey.generate() for name in ["coordinator", "trainer", "validator", "relay",
                                                  *[f"inference-{i}" for i in range(cfg.inference_nodes)]]}
    if cfg.coordinator_state is not None:
        link_elsewhere(out, "coordinator", cfg.coordinator_state)
    if cfg.store_dir is not None:  # the shared store's place (SimConfig refuses it without one)
        link_elsewhere(out, "shardcast", cfg.store_dir)
    for name, key in keys.items():
        (out / name).mkdir(exist_ok=True)
        key.save(out / name / "node.key")
    origin, relay_port = free_port(), free_port()
    run = write_run_toml(out, cfg, keys, origin, relay_port)
    plan_network_memory(out / "run.toml", keys["coordinator"].peer_id, cfg, placement)
    addr_file = out / "coordinator" / "addr"
    coord = Proc("coordinator", ["coordinator", "launch", "--config", str(out / "run.toml"), "--state",
                                 str(out / "coordinator"), "--key", str(out / "coordinator" / "node.key"),
                                 "--addr-file", str(addr_file),
                                 # the audit at the end reads every accepted unit: nothing may be pruned
                                 "--retain-versions", str(cfg.steps + 1)], out / "coordinator" / "log.txt")
    t0 = time.time()
    coord.start()
    bootstrap = wait_for(addr_file, coord, 60).splitlines()[0]
    spec = str(out / "coordinator" / "spec.json")
    n = cfg.inference_nodes
    cheater_names = [f"inference-{i}" for i in range(n - cfg.cheaters, n)]
    kinds = list(cfg.cheat_kinds)  # each cheater's kind, in turn (node/adversary.py: CHEATS, JUNK)

    store_flags = [*(["--store", str(out / "shardcast")] if cfg.shared_store else []),
                   *(["--store-max-gib", str(cfg.store_max_gib)] if cfg.store_max_gib else []),
                   *(["--store-payloads", str(cfg.store_payloads)] if cfg.store_payloads else [])]

    def member(name: str, role: str, extra: list[str] = (), launcher: list[str] = ()) -> Proc:
        argv = ["join", "--role", role, "--bootstrap", bootstrap, "--spec", spec, "--key",
                str(out / name / "node.key"), "--workdir", str(out / name), *store_flags, *extra]
        if name in cheater_names:  # the adversary's program: an inference node with its cheating hook
            return Proc(name, ["--cheat", kinds[cheater_names.index(name) % len(kinds)], *argv],
                        out / name / "log.txt", module="node.adversary")
        return Proc(name, argv, out / name / "log.txt", launcher)
    launcher, parallel_flags = trainer_launcher(cfg.trainer_parallel)
    checkpoints = [] if cfg.trainer_checkpoint_every is None else ["--checkpoint-every", str(cfg.trainer_checkpoint_every)]
    checkpoints += ["--master-float32"] if cfg.trainer_master_float32 else []
    procs = {"trainer": member("trainer", "trainer", ["--shardcast-port", str(origin), *parallel_flags,
                                                      "--device", placement.trainer, *checkpoints], launcher),
             "validator": member("validator", "validator", ["--device", placement.validator, "--trace-versions"]),
             "relay": member("relay", "relay", ["--shardcast-port", str(relay_port)])}
    for i in range(n):
        name = f"inference-{i}"
        extra = ["--engine", "vllm"] if i < cfg.vllm_nodes else \
            ["--engine", cfg.engine, "--device", placement.inference[i],
             *(["--ep", str(cfg.inference_ep)] if cfg.inference_ep > 1 else []),
             *(["--gpu-memory-share", str(placement.inference_memory_share(i))]
               if placement.inference[i].startswith("cuda") else [])]
        procs[name] = member(name, "inference", [*extra, "--trace-versions"])  # versions.jsonl: weight latency
    for p in procs.values() if mps is not None else ():
        p.env.update(mps.env)
    vllm_procs = [procs[f"inference-{i}"] for i in range(cfg.vllm_nodes)]
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
    return Network(out, cfg, run, keys, coord, procs, cheater_names, t0, mps=mps)


def stop_network(net: Network, status: str) -> None:
    procs, coord = net.members, net.coordinator
    if status == "done":  # the trainer exits by itself once done, and the coordinator then ends the run for
        # every member (exit 0 each, the coordinator after its grace): a SIGTERM now would race their exits
        end = time.time() + 30
        for p in [procs["trainer"], *procs.values(), coord]:
            try:
                if p.p is not None:
                    p.p.wait(max(0.1, end - time.time()))
            except subprocess.TimeoutExpired:
                pass
    # the trainer first: it stops training at once, not after every other member's shutdown (a run told to
    # stop a few steps after its reward target trained on for seconds of fast steps while they shut down)
    for p in sorted(procs.values(), key=lambda p: p is not procs.get("trainer")):
        p.stop()
    coord.stop()
    if net.mps is not None:
        net.mps.stop(net.out / "mps-log")
