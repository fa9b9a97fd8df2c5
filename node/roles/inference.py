"""Inference role: fetch the policy, lease work, roll out with the engine, prove, submit.

Invariants: a rollout's every token records the version that produced it (new versions are loaded
between two decode steps, in-flight sequences continue); proofs bind each version segment to the
manifest hash the coordinator announced; work the coordinator cancelled as stale is not
submitted. The role holds no cheating code: the simulation's adversary (node/adversary.py) installs
a `before_submit` hook in a node of its own.

The engine is looked up by name (`node/engine/registry.py`: "builtin", "builtin-cuda", "builtin-ep"
over `--ep N` processes, or "vllm", a supervised vLLM server from contrib/vllm, run by its own
interpreter, $PRIMERL_VLLM_PYTHON) and started while the node joins and fetches; the role drives only the registry's `InferenceEngine` surface. Submissions say
which engine sampled them (`engine`), and a run whose spec does not accept that engine is refused at
start (`EngineUnavailable`). With `--ep N`, this process is rank 0 (the network node) of an
expert-parallel world (node/engine/ep_world.py); ranks 1..N-1 run `_follow_rank_0` and never touch the
network.

Router replay: when the run's recipe asks for it (`router_replay`, on by default) and its model has
MoE layers, the engine records the experts it routed every position to (the built-in one with
`capture_experts`; vLLM through contrib/vllm's worker extension, which captures them with the
hidden states), and each submission carries them (`routed_experts`, node/model/routing.py) for the
validator to check and the trainer to replay. A rollout one of whose engine passes captured no
routes (a vLLM prefix-cache hit) is sent without.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import queue
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from node.engine import registry as engines
from node.engine.registry import EngineSetup, EngineUnavailable, InferenceEngine
from node.envs.rollout import Episodes, Rollout
from node.model.routing import RouteShape
from node.model.spec import resolve
from node.recipe import Recipe
from node.heap import settle_heap
from node.roles.common import (blank_model, environment, fetch_policy, model_config, retain_policies, router_replay,
                               tokenizer)
from node.roles.leased_groups import LeasedGroups
from node.roles.version0 import LocalVersion0, local_version0
from protocol.errors import ProtocolError, Refused
from protocol.identity import NodeKey
from protocol.client import CoordinatorClient
from protocol.messages import LeaseGrant, PolicyAnnounce, RolloutGroup, RunSpec
from node.thread_cpu import ThreadMonitor
from shardcast.store import Store
from verification.proof import prove_rollouts

log = logging.getLogger(__name__)

MAX_WAITING_GROUPS = 64
"""Groups whose (simulated) tool calls may be pending at once before the node stops leasing."""


def tool_wait(work_seed: int, median_s: float, alpha: float = 1.5) -> float:
    """Heavy-tailed (Pareto, shape `alpha`) wait of one episode's tool calls, the same for the same
    work (so runs at different k do the same work); stands in for sandboxed tool latency."""
    xm = median_s / 2 ** (1 / alpha)
    return min(xm * random.Random(work_seed).paretovariate(alpha), 20 * median_s)


PROVERS = 4
"""Threads that prove finished groups (`prove`: their CPU is its own family in the activity rows' `threads`)."""


class InferenceNode:
    LEASE_POLL_S = 0.1
    """How long a lease loop that got no work waits before asking again (at once when a newer version is queued
    meanwhile, `_held_newer`, or a fetch it waits on ends)."""
    FETCH_WAIT_S = 1.0
    """How long a lease loop that got no work while a newer version is fetched waits for it to be queued."""

    def __init__(self, key: NodeKey, spec: RunSpec, bootstrap: str, workdir: Path, leases_per_request: int = 8, engine: str = "builtin", vllm: list[str] | None = None,
                 device: str = "cpu", fp8: str | None = None, ep: int = 1, gpu_memory_share: float = 0.9,
                 store: Store | None = None):
        """`vllm`: with engine "vllm", `KEY=VALUE` overrides of contrib/vllm's VLLMSettings (join --vllm);
        `device`: where an in-process engine serves; `fp8`: the node's `--fp8` (None: the spec's `model.fp8`,
        which any value given must equal: `FP8Mismatch` otherwise);
        `ep`: expert-parallel processes (builtin-ep; this one is rank $RANK of them); `gpu_memory_share`: of the
        GPU memory free after the weights, what the engine's KV slots may take (they are sized from it)."""
        self.key, self.spec, self.bootstrap, self.workdir = key, spec, bootstrap, workdir
        self.store = store or Store(workdir / "shardcast")
        """The host's shardcast store (`join --store`; default WORKDIR/shardcast)."""
        self.version0 = LocalVersion0(spec)
        """This member's checkpoint as version 0 (checked once): loaded as is, and version 1's delta parent."""
        self.leases_per_request = leases_per_request
        self.tok = tokenizer(spec)
        self.env = environment(spec)
        self.recipe = Recipe.of(spec)
        self.hashes: dict[int, str] = {}
        self._announced_at: dict[int, float] = {}  # version -> when its announcement arrived (weight-latency breakdown)
        self._held_newer = asyncio.Event()
        """Set when a newer version is queued for the engine: a lease loop polling for work asks again at once."""
        self.engine: InferenceEngine | None = None
        self.routes = RouteShape.of(model_config(spec)) if router_replay(spec) else None
        """The route shape when submissions carry routed experts (None: they do not)."""
        self.engine_name = engine
        self.engine_claims = engines.entry(engine).claims
        """The engine name this node's submissions carry; the run must accept it."""
        if self.engine_claims not in spec.engines:
            raise EngineUnavailable(f"run {spec.run_id} does not accept {self.engine_claims} rollouts (its spec's "
                                    f"engines: {', '.join(spec.engines)}); its run.toml must list "
                                    f"\"{self.engine_claims}\" in engines")
        fp8 = engines.serving_fp8(spec.model.fp8, fp8)
        cfg = model_config(spec)
        # made in FP8 where the engine serves FP8 itself (not --ep): no high-precision twin of the weights
        self.engine_setup = EngineSetup(
            model=lambda: blank_model(spec, device, fp8 if ep == 1 else "off"), hf_config=cfg.to_hf_dict(), max_batch=self._max_batch,
            max_seq_len=cfg.max_position_embeddings, eos_id=self.tok.eos_id, encode=self.tok.encode,
            decode=self.tok.decode, bos_id=self.tok.bos_id, capture_experts=self.routes is not None,
            workdir=workdir, salt=spec.run_id, options=list(vllm or []), device=device, fp8=fp8, ep=ep,
            dtype=spec.model.dtype, model_dir=resolve(spec.model.source), gpu_memory_share=gpu_memory_share,
            min_batch=spec.group_size)
        self.engine_settings = engines.check(engine, self.engine_setup)
        """The engine's checked settings (a bad `--vllm` option fails here, before anything starts)."""
        self.submitted = self.refused = 0
        self._threads: ThreadMonitor | None = None
        """While serving with `on_round` hooks: the process's threads' CPU, each activity row's `threads`."""
        self.lease_s: collections.deque[float] = collections.deque(maxlen=10_000)
        """Seconds of the last lease calls that returned grants (the coordinator's round trip), for the stop line."""
        self.on_loaded: list[Callable[[int, dict], None]] = []
        """Hooks told (version, {t_announced, t_fetch, t_fetched, t_queued, fetch_stages_s}) when a version is
        queued for the engine (node/version_trace.py writes them down for benchmarks.weight_latency)."""
        self.on_swapped: list[Callable[[int, dict], None]] = []
        """Hooks told (version, {t_applied, stage_s, apply_s, staged_on_device, bytes, t_lease_asked, t_granted}) on
        the engine's thread when a version is in the served weights (built-in engines; node/version_trace.py):
        `t_lease_asked`, `t_granted`: when this node first asked for leases holding it, and first got some (None
        where it had not by then: the engine had other work), so a swap's wait splits into the lease's round trip
        and the admission after it."""
        self._lease_times: dict[int, dict[str, float]] = {}
        """Version -> {t_lease_asked, t_granted}: the first lease call holding it, and the first that granted."""
        self._swaps_watched = False
        self.on_round: list[Callable[[dict], None]] = []
        """Hooks told each rollout round ({t0, t1, groups, tokens, versions}: when the engine worked, how many
        tokens it sampled, with which policy versions); node/version_trace.py writes them down."""
        self.before_submit: list[Callable[[list[RolloutGroup], int], list[RolloutGroup]]] = []
        """Hooks that see each round's groups (and the newest loaded version) before they are submitted,
        and return the groups to submit. None on an honest node (node/adversary.py installs one)."""
        self._newest_loaded = -1
        self._fetching: asyncio.Task | None = None
        self._waiting: set[asyncio.Task] = set()
        self._loading = asyncio.Lock()  # one version applied at a time, never an older after a newer
        self._engine_start: asyncio.Task | None = None
        self._prover: ThreadPoolExecutor | None = None
        """While serving: the threads that prove finished groups (`PROVERS`)."""

    async def run(self, stop: asyncio.Event) -> None:
        if self.engine_setup.ep > 1 and int(os.environ.get("RANK", "0")) > 0:
            return await self._follow_rank_0()
        if os.environ.get("PRIMERL_SWITCH_INTERVAL_S"):
            # an experiment's knob only: Python's 5 ms switch interval served the 0.52B network best (session 42: an
            # A/B on one H100, trained 7,165 tok/s at 5 ms against 6,479 and 4,998 at 0.5 ms; docs/scale.md)
            sys.setswitchinterval(float(os.environ["PRIMERL_SWITCH_INTERVAL_S"]))
        # The engine starts while the node joins and fetches (a vLLM server takes tens of seconds).
        self._engine_start = asyncio.create_task(asyncio.to_thread(engines.build, self.engine_name, self.engine_setup))
        try:
            client = await CoordinatorClient.connect(self.key, self.spec, "inference", self.bootstrap, stop)
        except BaseException:
            await self._close_engine()
            raise
        client.on_policy(self._on_announce)
        try:
            while not stop.is_set() and client.policy_version < 0:
                await asyncio.sleep(0.2)
            await self._load(client.policy_version, None)
            await self._serve(client, stop)
        except asyncio.CancelledError:
            pass
        finally:
            await client.close("shutting down")
            await self._close_engine()
            waits = sorted(self.lease_s)
            log.info("inference %s stopped: %d groups submitted, %d refused; %d granting lease calls, median %.3f s, "
                     "max %.3f s", self.key.peer_id[-8:], self.submitted, self.refused, len(waits),
                     waits[len(waits) // 2] if waits else 0.0, waits[-1] if waits else 0.0)

    async def _follow_rank_0(self) -> None:
        """An expert-parallel rank > 0: no network; serve rank 0's orders until its stop (node.engine.ep_world).
        Only rank 0 decides when to stop (it must send the stop order, or ranks would hang in a
        collective): a signal here is logged and left to rank 0."""
        from node.engine.ep_spawn import watch_parent
        from node.engine.ep_world import follow

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, log.info, "signal %s: waiting for rank 0's stop order", sig.name)
        watch_parent()
        await asyncio.to_thread(follow, self.engine_setup)

    async def _close_engine(self) -> None:
        """Stop the engine, also while it is still starting (a server never outlives the node)."""
        if self._engine_start is None:
            return
        self.engine_setup.cancel.set()
        try:
            self.engine = self.engine or await asyncio.shield(self._engine_start)
        except BaseException:
            pass
        if self.engine is not None:
            await asyncio.to_thread(engines.close, self.engine)

    async def _on_announce(self, msg: PolicyAnnounce) -> None:
        self.hashes[msg.version] = msg.manifest_hash
        self._announced_at.setdefault(msg.version, time.time())
        if self._fetching is None or self._fetching.done():
            self._fetching = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        """Load the newest announced version; versions announced while a fetch runs are not
        missed (the loop goes again), and versions overtaken meanwhile are skipped."""
        while self.hashes and max(self.hashes) > self._newest_loaded:
            newest = max(self.hashes)
            await self._load(newest, self.hashes[newest])
            if self._newest_loaded < newest:
                break  # the fetch failed (logged); the next announcement retries

    async def _load(self, version: int, manifest_hash: str | None) -> None:
        """Fetch and queue `version` for the engine (applied between two decode steps)."""
        if version <= self._newest_loaded:
            return
        t_fetch = time.time()
        fetch_stages: dict = {}
        try:
            state = await local_version0(self.spec, self.store, manifest_hash, self.version0) if version == 0 else None
            fetch_stages["local_version0"] = state is not None
            state = state if state is not None else await fetch_policy(self.spec, self.store, version, manifest_hash,
                                                                        stages=fetch_stages, local=self.version0,
                                                                        retain=False)
        except ProtocolError as exc:
            log.warning("policy v%d not loaded: %s", version, exc)
            return
        t_fetched = time.time()
        if manifest_hash is None:
            signed = self.store.held_manifest(self.spec.run_id, version)  # whole, or local beside the trainer
            manifest_hash = signed.manifest.manifest_hash()
        self.hashes[version] = manifest_hash
        async with self._loading:
            if version <= self._newest_loaded:
                return  # a newer version was applied while this one was fetched
            if self.engine is None:
                try:
                    self.engine = await self._engine_start
                except Exception as exc:  # a server that died or never became healthy, a device that failed
                    raise EngineUnavailable(f"engine {self.engine_name} did not start: {exc}") from exc
                settle_heap()  # the engine is built: full collector passes no longer walk it between steps
            if self.on_swapped and not self._swaps_watched and hasattr(self.engine, "on_swap"):
                self._swaps_watched = True  # the built-in engines tell when a version is in their weights
                self.engine.on_swap.append(lambda v, row: [hook(v, {**row, **self._lease_times_of(v)})
                                                           for hook in self.on_swapped])
            await asyncio.to_thread(self.engine.load_weights, state, version)
            self._queued(version)
        times = {"t_announced": self._announced_at.get(version), "t_fetch": t_fetch, "t_fetched": t_fetched,
                 "t_queued": time.time(), "fetch_stages_s": fetch_stages}
        for hook in self.on_loaded:
            hook(version, times)
        log.info("policy v%d queued for the engine", version)
        await retain_policies(self.spec, self.store)  # after: deleting old payloads is not the new version's wait

    def _queued(self, version: int) -> None:
        """`version` is queued for the engine: leases holding it may be asked for, at once."""
        self._newest_loaded = version
        self._held_newer.set()

    def _lease_times_of(self, version: int) -> dict[str, float | None]:
        """`t_lease_asked` and `t_granted` of `version` (None where not yet). Read on the engine's thread: lookups
        only (the event loop's thread writes the dict and drops old versions from it, `_lease_more`)."""
        times = self._lease_times.get(version, {})
        return {"t_lease_asked": times.get("t_lease_asked"), "t_granted": times.get("t_granted")}

    @property
    def _max_batch(self) -> int:
        return self.leases_per_request * self.spec.group_size

    def _capacity_groups(self) -> int:
        """Groups this node holds at once: what the engine's slots decode together, plus half a lease
        request queued ahead (the engine never waits on a round trip to the coordinator), and never
        more than the tool waits allow."""
        slots = getattr(self.engine, "max_batch", self._max_batch)
        ahead = max(1, self.leases_per_request // 2)
        return max(1, slots // self.spec.group_size) + ahead

    async def _serve(self, client: CoordinatorClient, stop: asyncio.Event) -> None:
        """Lease work as the engine frees room and hand it to the engine's own thread, which steps
        without pause while anything is in flight (continuous batching across leases: no drain
        between rounds). Finished groups come back to this loop to be proved and submitted, off the
        engine's thread."""
        loop = asyncio.get_running_loop()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._room = asyncio.Event()
        self._in_flight = 0
        halt = threading.Event()
        failed: asyncio.Future = loop.create_future()
        driver = threading.Thread(target=self._drive_engine, args=(loop, halt, client, failed),
                                  name="engine", daemon=True)
        self._threads = ThreadMonitor().start() if self.on_round else None  # whose CPU the engine thread waits on
        self._prover = ThreadPoolExecutor(max_workers=PROVERS, thread_name_prefix="prove")
        driver.start()
        try:
            while not stop.is_set() and not failed.done():
                await self._lease_more(client)
            if failed.done():
                raise failed.result()
        finally:
            halt.set()
            await asyncio.to_thread(driver.join)
            if self._threads is not None:
                self._threads.stop()
            for task in list(self._waiting):
                task.cancel()
            self._prover.shutdown(wait=False, cancel_futures=True)
            self._prover = None  # a group the engine handed back while stopping is not proved

    async def _lease_more(self, client: CoordinatorClient) -> None:
        room = self._capacity_groups() - self._in_flight
        if room <= 0 or len(self._waiting) >= MAX_WAITING_GROUPS:
            self._room.clear()
            try:
                await asyncio.wait_for(self._room.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
            return
        try:
            t, holding = time.perf_counter(), self._newest_loaded
            if holding not in self._lease_times:  # a new version held: the oldest records go
                for old in [v for v in list(self._lease_times) if v < holding - 2]:
                    self._lease_times.pop(old, None)
                self._lease_times[holding] = {"t_lease_asked": time.time()}
            record = self._lease_times[holding]  # the dict the engine's thread reads (`_lease_times_of`)
            self._held_newer.clear()  # set again by a version queued from here on
            grants = await client.lease(min(self.leases_per_request, room), holds_version=holding)
            if grants:
                self.lease_s.append(time.perf_counter() - t)
                record.setdefault("t_granted", time.time())
        except Refused as exc:
            log.warning("lease refused: %s", exc)
            await asyncio.sleep(1.0)
            return
        if not grants:
            fetching = self._fetching
            if fetching is not None and not fetching.done() and max(self.hashes, default=-1) > self._newest_loaded:
                # a newer version is on its way (the coordinator answers a node behind at once): ask again once
                # it is queued for the engine, not every 0.1 s while it is fetched, nor once the fetching task
                # ends: that runs the store's retention after queueing, and the 5.2B node asked 0.68-0.90 s
                # after each version was queued (session 35)
                queued = asyncio.ensure_future(self._held_newer.wait())
                try:
                    await asyncio.wait({fetching, queued}, timeout=self.FETCH_WAIT_S,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    queued.cancel()
            else:  # poll; a version queued meanwhile (its leases wait on it at k = 1) asks again at once
                try:
                    await asyncio.wait_for(self._held_newer.wait(), self.LEASE_POLL_S)
                except asyncio.TimeoutError:
                    pass
            return
        self._in_flight += len(grants)
        self._inbox.put(grants)

    def _drive_engine(self, loop: asyncio.AbstractEventLoop, halt: threading.Event, client: CoordinatorClient,
                      failed: asyncio.Future) -> None:
        """The engine's thread: admit leased groups between steps, step while anything runs, hand each
        finished group back to the event loop; every second, one activity row for `on_round` hooks
        ({t0, t1, groups, tokens, versions, busy_s, cpu_s, started, in_flight_max, steps, decoding}: `busy_s` the
        seconds inside engine steps, `cpu_s` of them the thread's CPU time (the rest it waited for the interpreter's
        lock while the role's other threads ran, or for a core; a CUDA synchronisation spins, so a wait on the GPU
        counts as CPU time), `started` when each new policy version first sampled, `in_flight_max` the most leased
        groups in the engine at once, `steps` the engine steps, `decoding` the sequences they advanced, summed:
        a group stays leased until its longest member ends, so its finished members decode nothing), and `threads`, the
        process's threads' CPU and run-queue seconds by family over about the last second (node/thread_cpu.py: who
        held the lock or the cores while this thread waited; None where no lap was ready), and `phases`, the engine
        steps' {swap, prefill, decode, finish: [wall_s, cpu_s, times]} (built-in engines; None for others)."""
        groups = LeasedGroups(Episodes(self.engine, self.env, self.tok), self.spec.group_size, self.recipe.temperature)
        row = _ActivityRow(time.time())
        last_version = getattr(self.engine, "version", None)
        try:
            while not halt.is_set():
                try:
                    grants = self._inbox.get(timeout=0.05) if not self.engine.has_work() else self._inbox.get_nowait()
                except queue.Empty:
                    grants = None
                while grants is not None:
                    for grant in grants:
                        if client.lease_cancelled(grant):  # too stale before it started: no work spent on it
                            loop.call_soon_threadsafe(self._group_done, client, grant, None)
                            continue
                        groups.admit(grant, self.env.sample_task(grant.task_index))
                    try:
                        grants = self._inbox.get_nowait()
                    except queue.Empty:
                        grants = None
                row.in_flight_max = max(row.in_flight_max, len(groups))
                if self.engine.has_work():
                    t, cpu = time.time(), time.thread_time()
                    finished = groups.episodes.step()
                    row.busy_s += time.time() - t
                    row.cpu_s += time.thread_time() - cpu
                    row.steps += 1
                    row.decoding += groups.episodes.advanced(finished)
                    version = getattr(self.engine, "version", None)
                    if version is not None and version != last_version:
                        row.started.setdefault(version, t)
                        last_version = version
                    for rollout in finished:
                        row.add(rollout)
                    for grant, members in groups.finished(finished):
                        row.groups += 1
                        loop.call_soon_threadsafe(self._group_done, client, grant, members)
                if time.time() - row.t0 >= 1.0:
                    row = self._emit(loop, row)
            self._emit(loop, row)
        except BaseException as exc:  # a failing engine stops the node (as a failing round did)
            log.exception("engine thread failed")
            loop.call_soon_threadsafe(lambda: failed.done() or failed.set_result(exc))

    def _emit(self, loop: asyncio.AbstractEventLoop, row: "_ActivityRow") -> "_ActivityRow":
        if self.on_round and (row.busy_s > 0 or row.groups):
            done = row.as_dict(time.time())
            done["threads"] = self._threads.take() if self._threads is not None else None
            phases = getattr(self.engine, "phases", None)  # the built-in engines' (node/engine/core.py)
            done["phases"] = phases.take() if phases is not None else None
            loop.call_soon_threadsafe(lambda: [hook(done) for hook in self.on_round])
        return _ActivityRow(time.time())

    def _group_done(self, client: CoordinatorClient, grant: LeaseGrant, rollouts: list[Rollout] | None) -> None:
        """On the loop: a leased group left the engine (finished, or dropped as cancelled)."""
        self._in_flight -= 1
        self._room.set()
        if rollouts is None or self._prover is None:
            return
        task = asyncio.create_task(self._complete(client, grant, rollouts))
        self._waiting.add(task)
        task.add_done_callback(self._waiting.discard)

    async def _complete(self, client: CoordinatorClient, grant: LeaseGrant, rollouts: list[Rollout]) -> None:
        """Prove a finished group (off the engine's thread), let hooks see it, wait for its tools, submit."""
        group = await asyncio.get_running_loop().run_in_executor(self._prover, self._group_of, grant, rollouts)
        groups = [group]
        for hook in self.before_submit:
            groups = hook(groups, self._newest_loaded)
        wait = self.recipe.tool_wait_s
        for group in groups:
            await self._finish(client, grant, group, tool_wait(grant.seed, wait) if wait > 0 else 0.0)

    def _group_of(self, grant: LeaseGrant, rollouts: list[Rollout]) -> RolloutGroup:
        hidden = [(torch.cat([t.hidden for t in r.turns]), [v for v, m in zip(r.versions, r.loss_mask) if m])
                  for r in rollouts]
        proofs = prove_rollouts(hidden, {v: bytes.fromhex(h) for v, h in self.hashes.items()})
        subs = [r.to_submission(grant.work_id, proof, self.engine_claims, self.routes)
                for r, proof in zip(rollouts, proofs)]
        return RolloutGroup(work_id=grant.work_id, rollouts=subs)

    async def _finish(self, client: CoordinatorClient, grant: LeaseGrant, group: RolloutGroup, wait_s: float) -> None:
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        if client.lease_cancelled(grant):
            return  # too stale to be admitted: the coordinator already took it back
        await self._submit(client, group)

    def _roll_out(self, grants: list[LeaseGrant]) -> list[RolloutGroup]:
        """Every grant's group rolled out to the end at once and proved (blocking; the role itself streams
        groups through `_serve`): the same episodes, seeds and proofs."""
        groups = LeasedGroups(Episodes(self.engine, self.env, self.tok), self.spec.group_size, self.recipe.temperature)
        for grant in grants:
            groups.admit(grant, self.env.sample_task(grant.task_index))
        whole: dict[int, list[Rollout]] = {}
        while self.engine.has_work():
            for grant, members in groups.finished(groups.episodes.step()):
                whole[id(grant)] = members
        out = [self._group_of(grant, whole[id(grant)]) for grant in grants]
        for hook in self.before_submit:
            out = hook(out, self._newest_loaded)
        return out

    async def _submit(self, client: CoordinatorClient, group: RolloutGroup) -> None:
        try:
            await client.submit(group)
            self.submitted += 1
        except Refused as exc:  # stale, expired, re-granted, banned: an answer, not an outage
            self.refused += 1
            log.info("work %d refused: %s", group.work_id, exc)


class _ActivityRow:
    """The engine thread's tally over about a second of work (one `on_round` row)."""

    def __init__(self, t0: float):
        self.t0, self.busy_s, self.cpu_s, self.groups, self.tokens = t0, 0.0, 0.0, 0, 0
        self.in_flight_max = self.steps = self.decoding = 0
        self.versions: set[int] = set()
        self.started: dict[int, float] = {}

    def add(self, rollout: Rollout) -> None:
        sampled = [v for v, m in zip(rollout.versions, rollout.loss_mask) if m]
        self.tokens += len(sampled)
        self.versions.update(sampled)

    def as_dict(self, t1: float) -> dict:
        return {"t0": self.t0, "t1": t1, "groups": self.groups, "tokens": self.tokens,
                "versions": sorted(self.versions), "busy_s": self.busy_s, "cpu_s": self.cpu_s,
                "started": {str(v): t for v, t in self.started.items()}, "in_flight_max": self.in_flight_max,
                "steps": self.steps, "decoding": self.decoding}
