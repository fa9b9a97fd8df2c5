"""`primerl-node coordinator launch --config run.toml` and `primerl-node join --role ROLE --bootstrap ADDR`.

The coordinator validates `run.toml`, signs it as the run spec (its hash is what members agree
to), prints its bootstrap multiaddr and serves the status page and `/metrics`. A member fetches
the signed spec from `--spec` (a file the operator hands out, `coordinator launch` writes it next
to its state) and joins in one of four roles. Every role stops cleanly on SIGINT/SIGTERM (it
leaves the run, so its leases go back to the pool at once) and resumes from its state directory.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import logging
import os
import sys
from pathlib import Path

from node.heap import settle_heap
from node.launch_guard import LaunchError
from node.spec_handout import SPEC_PROTOCOL, fetch_spec, read_spec
from protocol.coordinator import RETAIN_VERSIONS, Coordinator
from protocol.coordinator_service import CoordinatorService
from protocol.errors import BannedPeer
from protocol.identity import NodeKey
from protocol.model_spec import TINY_MOE
from protocol.transport import PeerHost

log = logging.getLogger(__name__)

STOP_WAIT_S = 5.0
"""After SIGTERM/SIGINT a role gets this long to notice the stop by itself, then its task is cancelled."""
SHUTDOWN_GRACE_S = 15.0
"""A role must finish its clean shutdown (leave, stop servers) within this after SIGTERM/SIGINT
(the sim waits 20 s before it SIGKILLs)."""

EXIT_RANK_LOST = 4
"""Exit code of an expert-parallel inference node one of whose ranks failed or went away mid-run."""


def quiet_libp2p() -> None:
    """py-libp2p's auto-connector and friends log at INFO every tick. Its import leaves the "libp2p"
    logger without handlers and not propagating, so its warnings reached stderr bare (no time, no
    name, via logging's last resort); they go through the one formatter instead."""
    for name in ("libp2p", "multiaddr", "async_service"):
        logging.getLogger(name).setLevel(logging.WARNING)
    root = logging.getLogger()
    lib = logging.getLogger("libp2p")
    if root.handlers and not lib.handlers:  # some of its modules set INFO themselves: warnings only
        handler = logging.StreamHandler()
        handler.setFormatter(root.handlers[0].formatter)
        handler.setLevel(logging.WARNING)
        lib.addHandler(handler)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # every failed dial or stream (4-7 lines each, at ERROR); protocol.client's one line per retry says it
    for name in ("libp2p.transport.tcp", "libp2p.host.basic_host", "libp2p.protocol_muxer.multiselect_client"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


async def launch_coordinator(config: Path, state: Path, key_path: Path, addr_file: Path | None = None,
                             retain_versions: int = RETAIN_VERSIONS) -> None:
    from node.roles.status import serve_status
    from node.stop_signals import stop_on_signals
    from node.run_config import RunConfig
    from node.launch_guard import StateLock, listen_free
    from verification.verdict import selected_for_verification

    cfg = RunConfig.load(config)
    lock = StateLock(state).acquire()  # before anything in the state is read or written
    key = NodeKey.load_or_create(key_path)
    spec = cfg.run_spec(key.peer_id)
    if spec.model.source != TINY_MOE and spec.model.weights_hash is None:
        log.warning("run.toml's [model] pins no weights_hash: members will not check that their version 0 is the "
                    "checkpoint this run names; `primerl-node model pin %s` prints the table with it", spec.model.source)
    (state / "spec.json").write_text(spec.model_dump_json())
    stop = stop_on_signals()
    listen_free(cfg.listen)
    host = PeerHost(key, cfg.listen)
    await host.start()
    if not host.addrs:  # py-libp2p logs a failed listen and starts with no address
        await host.stop()
        raise LaunchError(f"cannot listen on {cfg.listen} (run.toml `listen`): the address is in use or not "
                          "this machine's")
    # Which units need a verdict is keyed by a secret only the coordinator holds (nodes cannot predict it).
    secret = hmac.new(key.private_bytes(), b"primerl-node/verification-selection", hashlib.sha256).digest()
    service = CoordinatorService(key, Coordinator(state, spec, retain_versions=retain_versions, defer_fsync=True), host,
                                 selector=lambda wid: selected_for_verification(wid, spec.verification_rate, secret))
    await service.start()
    settle_heap()  # what the coordinator built (libp2p host, store): full collector passes no longer walk it
    spec_bytes = spec.model_dump_json().encode()

    async def hand_out_spec(remote: str, data: bytes) -> bytes:
        return spec_bytes
    host.serve(SPEC_PROTOCOL, hand_out_spec)
    try:
        runner, port = await serve_status(service, cfg.status_port)
    except OSError as exc:
        await service.stop()
        service.state.close()
        await host.stop()
        raise LaunchError(f"cannot serve the status page on port {cfg.status_port} (run.toml `status_port`; 0 "
                          f"picks a free port): {exc.strerror or exc}") from None
    bootstrap = next(a for a in host.addrs if "/p2p/" in a) if any("/p2p/" in a for a in host.addrs) else host.addrs[0]
    print(f"bootstrap: {bootstrap}\nstatus: http://127.0.0.1:{port}/\nspec: {state / 'spec.json'}", flush=True)
    if addr_file is not None:
        tmp = addr_file.with_suffix(".tmp")
        tmp.write_text(f"{bootstrap}\nhttp://127.0.0.1:{port}/\n")
        tmp.replace(addr_file)
    ended = asyncio.create_task(service.ended.wait())
    await asyncio.wait([asyncio.create_task(stop.wait()), ended], return_when=asyncio.FIRST_COMPLETED)
    log.info("coordinator stopping%s", ": the run is over" if ended.done() else "")
    await runner.cleanup()
    await service.stop()
    await host.stop()  # no request may reach a closed state (members got InternalError: ProgrammingError)
    service.state.close()
    lock.release()


async def join(role: str, spec_path: Path | None, bootstrap: str, key_path: Path | None, workdir: Path,
               shardcast_port: int, engine: str = "builtin", parallel: dict | None = None,
               host: str = "127.0.0.1", vllm: list[str] | None = None, customize=None,
               device: str = "cpu", fp8: str | None = None, ep: int = 1, gpu_memory_share: float = 0.9,
               store_dir: Path | None = None, store_max_gib: float | None = None,
               memory_limit_gib: float | None = None, store_payloads: Path | None = None,
               checkpoint_every: int | None = None, master_float32: bool = False) -> None:
    """Run one role until SIGINT/SIGTERM, after its memory plan (`plan_memory`) fits. `customize(node)`: called on the role object before it runs
    (node/adversary.py makes an inference node a cheater this way). `ep`: an inference node's
    expert-parallel processes: not under torchrun, this process becomes rank 0 and starts the others."""
    from node.stop_signals import stop_on_signals

    spec = read_spec(spec_path, bootstrap) if spec_path else await fetch_spec(bootstrap)
    workdir.mkdir(parents=True, exist_ok=True)
    key_path = key_path or workdir / "node.key"
    world = role == "trainer" or (role == "inference" and ep > 1)
    if world and int(os.environ.get("RANK", "0")) > 0:
        # ranks > 0 never touch the network: they must not race rank 0 to create its key
        key = NodeKey.load(key_path) if key_path.exists() else NodeKey.generate()
    else:
        key = NodeKey.load_or_create(key_path)
    stop = stop_on_signals()
    # both before anything is allocated, one line and exit 2 each: the plan (config.json alone), then the
    # checkpoint's headers (a broken or foreign checkpoint)
    plan = None if role == "relay" else \
        plan_memory(spec, role, device, parallel=parallel, engine=engine, fp8=fp8, limit_gib=memory_limit_gib,
                    master_float32=master_float32)
    if role != "relay":  # (a relay moves bytes: it never imports torch)
        from node.roles.common import check_checkpoint

        check_checkpoint(spec)
    from shardcast.store import Store

    try:
        store = Store(store_dir or workdir / "shardcast", payload_root=store_payloads,
                      max_bytes=None if store_max_gib is None else int(store_max_gib * 2**30))
    except ValueError as exc:
        raise SystemExit(f"primerl-node join: {exc}") from None
    if role == "inference":
        from node.roles.inference import InferenceNode
        node = InferenceNode(key, spec, bootstrap, workdir, engine=engine, vllm=vllm, device=device, fp8=fp8, ep=ep,
                             gpu_memory_share=gpu_memory_share, store=store)
    elif role == "trainer":
        from node.roles.trainer import TrainerNode
        node = TrainerNode(key, spec, bootstrap, workdir, shardcast_port, parallel=parallel, host=host, device=device,
                           store=store, micro_batch_tokens=plan.micro_batch_tokens, master_float32=master_float32,
                           **({} if checkpoint_every is None else {"checkpoint_every": checkpoint_every}))
    elif role == "validator":
        from node.roles.validator import ValidatorNode
        node = ValidatorNode(key, spec, bootstrap, workdir, device=device, store=store)
    else:
        from node.roles.relay import RelayNode
        node = RelayNode(key, spec, bootstrap, workdir, shardcast_port, host=host, store=store)
    if customize is not None:
        customize(node)
    followers = None
    if role == "inference" and ep > 1 and "RANK" not in os.environ:  # one command: the other ranks are ours to start
        from node.engine.ep_spawn import spawn_followers

        if spec_path is None:
            spec_path = workdir / "spec.json"
            spec_path.write_text(spec.model_dump_json())
        argv = [sys.executable, "-m", "node.cli", "--log-level", logging.getLevelName(logging.getLogger().level),
                "join", "--role", "inference", "--bootstrap", bootstrap, "--spec", str(spec_path), "--workdir",
                str(workdir), "--engine", engine, "--ep", str(ep), "--device", device.split(":")[0], "--store", str(store.root)]
        followers = spawn_followers(ep, argv, workdir)
    try:
        await _run_role(role, node, key, stop, ep)
    finally:
        if followers is not None:
            await asyncio.to_thread(followers.close)


def plan_memory(spec, role: str, device: str, parallel: dict | None = None, engine: str = "builtin",
                fp8: str | None = None, limit_gib: float | None = None, master_float32: bool = False):
    """The role's memory plan (None: a role or engine that plans none), printed next to what its device has
    free (`--memory-limit-gib` caps that); `MemoryPlanDoesNotFit` (one line, exit 2) before the role builds
    anything when it does not fit."""
    from node.engine.memory_plan import host_or_gpu_free
    from node.roles.memory import role_plan

    plan = role_plan(spec, role, device, host_or_gpu_free(device, limit_gib), parallel=parallel, engine=engine, fp8=fp8,
                     master_float32=master_float32)
    if plan is not None:
        print(plan.describe(), flush=True)
        plan.check()
    return plan


async def _run_role(role: str, node, key: NodeKey, stop: asyncio.Event, ep: int) -> None:
    print(f"node id: {key.peer_id} ({role})", flush=True)
    task = asyncio.create_task(node.run(stop))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([task, stopper], return_when=asyncio.FIRST_COMPLETED)
    stop.set()
    done, _ = await asyncio.wait([task], timeout=STOP_WAIT_S)
    if not done:  # blocked on a peer (a fetch from a trainer that is gone): cancel; its finally leaves the run
        log.warning("%s still busy %.0fs after the stop signal: cancelling its work", role, STOP_WAIT_S)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=SHUTDOWN_GRACE_S - STOP_WAIT_S)
    if not done:
        from node.roles.common import dump_tasks
        log.error("%s did not stop within %.0fs of the stop signal; its tasks follow", role, SHUTDOWN_GRACE_S)
        dump_tasks()
        task.cancel()
        raise SystemExit(1)
    if not task.cancelled():  # cancelled: stopped before it had joined, nothing to leave
        try:
            task.result()
        except BannedPeer:
            pass  # said below, with its own exit code
        except RuntimeError as exc:
            if role == "inference" and ep > 1:
                from node.engine.ep_world import EPRankLost

                if isinstance(exc, EPRankLost):  # the node has left the run; say why in one line
                    print(f"primerl-node {role}: error: {exc}", file=sys.stderr, flush=True)
                    sys.stdout.flush()
                    # not SystemExit: the broken world's gloo threads can abort the interpreter's finalization
                    # (exit -6 instead of this code: seen in the EP role's test worker)
                    os._exit(EXIT_RANK_LOST)
            raise
    if getattr(stop, "why", ""):
        print(f"primerl-node {role}: {stop.why}", file=sys.stderr if stop.exit_code else sys.stdout, flush=True)
    if getattr(stop, "exit_code", 0):
        raise SystemExit(stop.exit_code)


def register(sub: argparse._SubParsersAction) -> None:
    from node.config_flags import add_flags
    from node.engine.registry import ENGINES
    from node.join_config import JoinConfig, LaunchConfig

    c = sub.add_parser("coordinator", help="run a coordinator")
    csub = c.add_subparsers(dest="coordinator_command", metavar="ACTION")
    lp = csub.add_parser("launch", help="validate and sign run.toml, serve the run (bootstrap, status page, /metrics)")
    add_flags(lp, LaunchConfig)
    lp.set_defaults(func=_launch)
    j = sub.add_parser("join", help="join a run as inference | trainer | validator | relay")
    engine = add_flags(j, JoinConfig)["engine"]
    engine.choices = list(ENGINES)
    engine.help += ": " + "; ".join(f"{n}: {e.help}" for n, e in ENGINES.items())
    j.set_defaults(func=_join)


def _launch(args: argparse.Namespace) -> int:
    from node.config_flags import config_from
    from node.join_config import LaunchConfig

    cfg = config_from(LaunchConfig, args)
    quiet_libp2p()
    asyncio.run(launch_coordinator(cfg.config, cfg.state, cfg.key or cfg.state / "coordinator.key", cfg.addr_file,
                                   cfg.retain_versions))
    return 0


def _customizer(args: argparse.Namespace):
    """What to install on the role before it runs: the version trace (`--trace-versions`) and what a
    caller passed (node/adversary.py's cheating hook)."""
    steps = [f for f in (getattr(args, "customize", None),) if f is not None]
    if args.trace_versions:
        if args.role not in ("inference", "validator"):
            raise SystemExit("primerl-node join: --trace-versions applies to --role inference or validator only")
        from node.version_trace import install
        steps.append(install)
    return (lambda node: [f(node) for f in steps]) if steps else None


def _join(args: argparse.Namespace) -> int:
    from node.config_flags import config_from
    from node.join_config import JoinConfig

    quiet_libp2p()
    customize = _customizer(args)
    cfg = config_from(JoinConfig, args)
    if cfg.role != "trainer" and ((cfg.dp, cfg.cp) != (1, 1) or cfg.activation_checkpointing or cfg.master_float32):
        raise SystemExit("primerl-node join: --dp/--cp/--activation-checkpointing/--master-float32 apply to --role "
                         "trainer only")
    if cfg.role not in ("trainer", "inference") and cfg.ep != 1:
        raise SystemExit("primerl-node join: --ep applies to --role trainer or inference only")
    if cfg.role != "inference" and cfg.engine is not None:
        raise SystemExit("primerl-node join: --engine applies to --role inference only")
    engine = cfg.engine or ("builtin-ep" if cfg.role == "inference" and cfg.ep > 1 else "builtin")
    if cfg.vllm and engine != "vllm":
        raise SystemExit("primerl-node join: --vllm applies to --engine vllm only")
    device = cfg.device or ("cuda" if engine == "builtin-cuda" else "cpu")
    ep = cfg.ep if cfg.role == "inference" else 1
    if ep > 1 and device.startswith("cuda"):
        if device != "cuda":
            raise SystemExit(f"primerl-node join: --ep {ep} serves on cuda:0..{ep - 1} (rank R on cuda:R; "
                             f"CUDA_VISIBLE_DEVICES picks which GPUs): pass --device cuda, not {device}")
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    if cfg.role != "inference" and cfg.fp8 is not None:
        raise SystemExit("primerl-node join: --fp8 applies to --role inference only")
    from node.roles.common import check_device
    try:
        check_device(device)
    except ValueError as exc:
        raise SystemExit(f"primerl-node join: {exc}") from None
    asyncio.run(join(cfg.role, cfg.spec, cfg.bootstrap, cfg.key, cfg.workdir, cfg.shardcast_port,
                     engine=engine, parallel=cfg.parallel(), host=cfg.host, vllm=cfg.vllm,
                     customize=customize, device=device, fp8=cfg.fp8, ep=ep,
                     gpu_memory_share=cfg.gpu_memory_share, store_dir=cfg.store, store_max_gib=cfg.store_max_gib,
                     memory_limit_gib=cfg.memory_limit_gib, store_payloads=cfg.store_payloads,
                     checkpoint_every=cfg.checkpoint_every, master_float32=cfg.master_float32))
    return 0
