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
import logging
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch

from node.engine import SamplingParams
from node.engine import registry as engines
from node.engine.registry import EngineSetup, EngineUnavailable, InferenceEngine
from node.envs.rollout import run_episodes
from node.model.routing import RouteShape
from node.model.spec import resolve
from node.recipe import Recipe
from node.roles.common import blank_model, environment, fetch_policy, model_config, router_replay, tokenizer
from protocol.errors import ProtocolError, Refused
from protocol.identity import NodeKey
from protocol.client import CoordinatorClient
from protocol.messages import LeaseGrant, PolicyAnnounce, RolloutGroup, RunSpec
from protocol.work import sampling_seed
from verification.proof import prove_rollouts

log = logging.getLogger(__name__)

MAX_WAITING_GROUPS = 64
"""Groups whose (simulated) tool calls may be pending at once before the node stops leasing."""


def tool_wait(work_seed: int, median_s: float, alpha: float = 1.5) -> float:
    """Heavy-tailed (Pareto, shape `alpha`) wait of one episode's tool calls, the same for the same
    work (so runs at different k do the same work); stands in for sandboxed tool latency."""
    xm = median_s / 2 ** (1 / alpha)
    return min(xm * random.Random(work_seed).paretovariate(alpha), 20 * median_s)


class InferenceNode:
    def __init__(self, key: NodeKey, spec: RunSpec, bootstrap: str, workdir: Path, leases_per_request: int = 8, engine: str = "builtin", vllm: list[str] | None = None,
                 device: str = "cpu", fp8: str | None = None, ep: int = 1):
        """`vllm`: with engine "vllm", `KEY=VALUE` overrides of contrib/vllm's VLLMSettings (join --vllm);
        `device`: where an in-process engine serves; `fp8`: the node's `--fp8` (None: the spec's `model.fp8`,
        which any value given must equal: `FP8Mismatch` otherwise);
        `ep`: expert-parallel processes (builtin-ep; this one is rank $RANK of them)."""
        self.key, self.spec, self.bootstrap, self.workdir = key, spec, bootstrap, workdir
        self.leases_per_request = leases_per_request
        self.tok = tokenizer(spec)
        self.env = environment(spec)
        self.recipe = Recipe.of(spec)
        self.hashes: dict[int, str] = {}
        self._announced_at: dict[int, float] = {}  # version -> when its announcement arrived (weight-latency breakdown)
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
        self.engine_setup = EngineSetup(
            model=lambda: blank_model(spec), hf_config=cfg.to_hf_dict(), max_batch=self._max_batch,
            max_seq_len=cfg.max_position_embeddings, eos_id=self.tok.eos_id, encode=self.tok.encode,
            decode=self.tok.decode, bos_id=self.tok.bos_id, capture_experts=self.routes is not None,
            workdir=workdir, salt=spec.run_id, options=list(vllm or []), device=device, fp8=fp8, ep=ep,
            model_dir=resolve(spec.model.source))
        self.engine_settings = engines.check(engine, self.engine_setup)
        """The engine's checked settings (a bad `--vllm` option fails here, before anything starts)."""
        self.submitted = self.refused = 0
        self.on_loaded: list[Callable[[int, dict[str, float | None]], None]] = []
        """Hooks told (version, {t_announced, t_fetch, t_fetched, t_queued}) when a version is queued for
        the engine (node/version_trace.py writes them down for benchmarks.weight_latency)."""
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

    async def run(self, stop: asyncio.Event) -> None:
        if self.engine_setup.ep > 1 and int(os.environ.get("RANK", "0")) > 0:
            return await self._follow_rank_0()
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
            while not stop.is_set():
                await self._one_round(client)
        except asyncio.CancelledError:
            pass
        finally:
            await client.close("shutting down")
            await self._close_engine()
            log.info("inference %s stopped: %d groups submitted, %d refused", self.key.peer_id[-8:],
                     self.submitted, self.refused)

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
        try:
            state = await fetch_policy(self.spec, self.workdir / "shardcast", version, manifest_hash)
        except ProtocolError as exc:
            log.warning("policy v%d not loaded: %s", version, exc)
            return
        t_fetched = time.time()
        if manifest_hash is None:
            from shardcast.store import Store
            signed = Store(self.workdir / "shardcast").manifest(self.spec.run_id, version)
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
            await asyncio.to_thread(self.engine.load_weights, state, version)
            self._newest_loaded = version
        times = {"t_announced": self._announced_at.get(version), "t_fetch": t_fetch, "t_fetched": t_fetched,
                 "t_queued": time.time()}
        for hook in self.on_loaded:
            hook(version, times)
        log.info("policy v%d queued for the engine", version)

    @property
    def _max_batch(self) -> int:
        return self.leases_per_request * self.spec.group_size

    async def _one_round(self, client: CoordinatorClient) -> None:
        t_lease = time.time()
        try:
            grants = await client.lease(self.leases_per_request, holds_version=self._newest_loaded)
        except Refused as exc:
            log.warning("lease refused: %s", exc)
            await asyncio.sleep(1.0)
            return
        if not grants:
            await asyncio.sleep(0.1)
            return
        t0 = time.time()
        groups = await asyncio.to_thread(self._roll_out, grants)
        t1 = time.time()
        wait = self.recipe.tool_wait_s
        if wait <= 0:  # the round's groups at once: one group commit at the coordinator, not one round trip each
            await asyncio.gather(*(self._finish(client, grant, group, 0.0) for grant, group in zip(grants, groups)))
        else:  # episodes wait on their tools concurrently while the engine starts the next round
            for grant, group in zip(grants, groups):
                task = asyncio.create_task(self._finish(client, grant, group, tool_wait(grant.seed, wait)))
                self._waiting.add(task)
                task.add_done_callback(self._waiting.discard)
        if self.on_round:  # t_lease: lease asked; t0-t1: the engine's round; t_submitted: its groups answered
            subs = [sub for group in groups for sub in group.rollouts]
            row = {"t_lease": t_lease, "t0": t0, "t1": t1, "t_submitted": time.time() if wait <= 0 else None,
                   "groups": len(groups), "tokens": sum(s.n_tokens for s in subs),
                   "versions": sorted({v for s in subs for v in s.token_versions}),
                   "lease_versions": sorted({g.policy_version for g in grants})}
            for hook in self.on_round:
                hook(row)
        while len(self._waiting) >= MAX_WAITING_GROUPS:
            await asyncio.wait(set(self._waiting), return_when=asyncio.FIRST_COMPLETED)

    async def _finish(self, client: CoordinatorClient, grant: LeaseGrant, group: RolloutGroup, wait_s: float) -> None:
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        if client.lease_cancelled(grant):
            return  # too stale to be admitted: the coordinator already took it back
        await self._submit(client, group)

    def _roll_out(self, grants: list[LeaseGrant]) -> list[RolloutGroup]:
        g = self.spec.group_size
        temperature = self.recipe.temperature
        episodes = []
        for grant in grants:
            task = self.env.sample_task(grant.task_index)
            for j in range(g):
                episodes.append((f"{grant.work_id}-{j}", task,
                                 SamplingParams(temperature=temperature, seed=sampling_seed(grant.seed, j))))
        rollouts = run_episodes(self.engine, self.env, self.tok, episodes)
        hidden = [(torch.cat([t.hidden for t in r.turns]), [v for v, m in zip(r.versions, r.loss_mask) if m])
                  for r in rollouts]
        proofs = prove_rollouts(hidden, {v: bytes.fromhex(h) for v, h in self.hashes.items()})
        out = []
        for i, grant in enumerate(grants):
            subs = [rollouts[i * g + j].to_submission(grant.work_id, proofs[i * g + j], self.engine_claims, self.routes)
                    for j in range(g)]
            out.append(RolloutGroup(work_id=grant.work_id, rollouts=subs))
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
