"""Inference role: fetch the policy, lease work, roll out with the engine, prove, submit.

Invariants: a rollout's every token records the version that produced it (new versions are loaded
between two decode steps, in-flight sequences continue); proofs bind each version segment to the
manifest hash the coordinator announced; work the coordinator cancelled as stale is not
submitted. A cheating node (`cheat`, for the simulation) tampers with some of its groups; the
validator must catch every one.

With `engine="vllm"` the rollouts come from a supervised vLLM server (contrib/vllm, run by its own
interpreter, $PRIMERL_VLLM_PYTHON), started without weights while the node joins and fetches (its
start-up takes tens of seconds; WORKDIR/engine.ready marks the end); every fetched version is written
as an HF checkpoint and loaded in place. Its submissions say so (`engine`), and a run whose spec does
not accept vLLM is refused at start (`EngineUnavailable`).

Router replay: when the run's recipe asks for it (`router_replay`, on by default) and its model has
MoE layers, the engine records the experts it routed every position to (the built-in one with
`capture_experts`; vLLM through contrib/vllm's worker extension, which captures them with the
hidden states), and each submission carries them (`routed_experts`, node/model/routing.py) for the
validator to check and the trainer to replay. A rollout one of whose engine passes captured no
routes (a vLLM prefix-cache hit) is sent without.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from node.engine import Engine, Request, SamplingParams
from node.envs.rollout import run_episodes
from node.model.checkpoint import CONFIG, WEIGHTS
from node.model.routing import RouteShape
from node.recipe import Recipe
from node.roles.common import blank_model, environment, fetch_policy, model_config, router_replay, tokenizer
from protocol.errors import ProtocolError, Refused
from protocol.identity import NodeKey
from protocol.client import CoordinatorClient
from protocol.messages import LeaseGrant, PolicyAnnounce, RolloutGroup, RolloutSubmission, RunSpec
from protocol.work import sampling_seed
from verification.proof import prove_rollouts

log = logging.getLogger(__name__)

MAX_WAITING_GROUPS = 64
"""Groups whose (simulated) tool calls may be pending at once before the node stops leasing."""
CHEATS = ("reward", "tokens", "version")
"""Tampering kinds a simulated cheater mixes (see verification's attack classes)."""
VLLM_CHECKPOINTS_KEPT = 2
"""Checkpoint directories written for vLLM that stay on disk (the loaded version and the one before)."""
VLLM_NODE_OWNED = ("model", "load_format")
"""VLLMSettings the node sets itself (the checkpoint it serves and how it is loaded)."""
VLLM_DTYPE = "float32"
"""vLLM's dtype: the run's policies are float32, which the validator recomputes in (its thresholds)."""


class EngineUnavailable(RuntimeError):
    """The engine asked for cannot serve this run: the run does not accept its rollouts, or it is not
    installed here (no usable $PRIMERL_VLLM_PYTHON)."""


def tool_wait(work_seed: int, median_s: float, alpha: float = 1.5) -> float:
    """Heavy-tailed (Pareto, shape `alpha`) wait of one episode's tool calls, the same for the same
    work (so runs at different k do the same work); stands in for sandboxed tool latency."""
    xm = median_s / 2 ** (1 / alpha)
    return min(xm * random.Random(work_seed).paretovariate(alpha), 20 * median_s)


def write_hf_checkpoint(state: dict[str, torch.Tensor], spec: RunSpec, directory: Path) -> Path:
    """A fetched version (HF names, as the trainer publishes it) as a checkpoint directory vLLM loads;
    written beside and renamed, so a crash never leaves a half-written directory under its name."""
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / CONFIG).write_text(json.dumps(model_config(spec).to_hf_dict(), indent=2))
    save_file({k: t.contiguous() for k, t in state.items()}, str(tmp / WEIGHTS), metadata={"format": "pt"})
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)
    return directory


def tamper(sub: RolloutSubmission, kind: str, newest: int) -> RolloutSubmission:
    if kind == "reward":
        return sub.model_copy(update={"reward": 1.0 if sub.reward < 1.0 else 0.0})
    if kind == "tokens":
        toks = list(sub.token_ids)
        toks[0] = (toks[0] + 7) % 80 + 4
        return sub.model_copy(update={"token_ids": toks})
    # "version": claim the tokens came from another policy version than the one that made them
    other = newest - 1 if sub.min_version == newest else newest
    return sub.model_copy(update={"version_runs": [(max(0, other), sub.n_tokens)]})


class InferenceNode:
    def __init__(self, key: NodeKey, spec: RunSpec, bootstrap: str, workdir: Path, cheat: str | None = None,
                 leases_per_request: int = 8, engine: str = "builtin", vllm: list[str] | None = None):
        """`vllm`: with engine "vllm", `KEY=VALUE` overrides of contrib/vllm's VLLMSettings (join --vllm)."""
        self.key, self.spec, self.bootstrap, self.workdir = key, spec, bootstrap, workdir
        self.engine_kind = engine
        self.cheat = cheat
        self.leases_per_request = leases_per_request
        self._vllm_settings: dict[str, object] = {}
        if engine == "vllm":
            self._vllm_settings = self._check_vllm(vllm or [])
        self.tok = tokenizer(spec)
        self.env = environment(spec)
        self.recipe = Recipe.of(spec)
        self.hashes: dict[int, str] = {}
        self._announced_at: dict[int, float] = {}  # version -> when its announcement arrived (weight-latency breakdown)
        self.engine: Engine | None = None  # or contrib's VLLMEngine: the same surface
        self.routes = RouteShape.of(model_config(spec)) if router_replay(spec) else None
        """The route shape when submissions carry routed experts (None: they do not)."""
        self.submitted = self.refused = 0
        self._rng = random.Random(key.peer_id)
        self._newest_loaded = -1
        self._fetching: asyncio.Task | None = None
        self._waiting: set[asyncio.Task] = set()
        self._loading = asyncio.Lock()  # one version applied at a time, never an older after a newer
        self._vllm_start: asyncio.Task | None = None
        self._vllm_cancel = threading.Event()

    def _check_vllm(self, options: list[str]) -> dict[str, object]:
        """The vLLM settings this node starts with, once the run, the interpreter and `options` are checked."""
        if "vllm" not in self.spec.engines:
            raise EngineUnavailable(f"run {self.spec.run_id} does not accept vLLM rollouts (its spec's engines: "
                                    f"{', '.join(self.spec.engines)}); its run.toml must list \"vllm\" in engines")
        from contrib.vllm import vllm_python
        from contrib.vllm.server import VLLMUnavailable
        try:
            vllm_python()
        except VLLMUnavailable as exc:
            raise EngineUnavailable(str(exc)) from exc
        from pydantic import ValidationError

        from contrib.vllm.settings import VLLMSettings
        settings: dict[str, object] = {"dtype": VLLM_DTYPE, "max_num_seqs": self._max_batch,
                                       "max_model_len": model_config(self.spec).max_position_embeddings}
        for option in options:
            name, sep, value = option.partition("=")
            if not sep or name in VLLM_NODE_OWNED or name not in VLLMSettings.model_fields:
                raise EngineUnavailable(f"--vllm {option!r}: expected KEY=VALUE with KEY a VLLMSettings field "
                                        f"other than {', '.join(VLLM_NODE_OWNED)}")
            settings[name] = value
        try:
            checked = VLLMSettings(model="-", load_format="dummy", **settings)
        except ValidationError as exc:
            raise EngineUnavailable(f"--vllm: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}") from exc
        return {name: getattr(checked, name) for name in settings}

    async def run(self, stop: asyncio.Event) -> None:
        if self.engine_kind == "vllm":
            self._vllm_start = asyncio.create_task(asyncio.to_thread(self._start_vllm))
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

    async def _close_engine(self) -> None:
        """Stop the vLLM server, also while it is still starting (the server never outlives the node)."""
        if self._vllm_start is None:
            return
        self._vllm_cancel.set()
        try:
            await asyncio.shield(self._vllm_start)
        except BaseException:
            pass
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)

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
            if self.engine_kind == "vllm":
                try:
                    await self._vllm_start
                except (RuntimeError, OSError) as exc:  # VLLMServerError: it died or never became healthy
                    raise EngineUnavailable(f"vLLM did not start: {exc}") from exc
                await asyncio.to_thread(self._load_vllm, state, version)
            else:
                if self.engine is None:
                    model = blank_model(self.spec)  # the fetched version is loaded into it before any step
                    self.engine = Engine(model, max_batch=self._max_batch, eos_id=self.tok.eos_id,
                                         decode=self.tok.decode, capture_hidden=True,
                                         capture_experts=self.routes is not None, version=version)
                self.engine.load_weights(state, version)
            self._newest_loaded = version
        with (self.workdir / "versions.jsonl").open("a") as f:  # weight-latency benchmark reads this
            f.write(json.dumps({"version": version, "t_announced": self._announced_at.get(version), "t_fetch": t_fetch,
                                "t_fetched": t_fetched, "t_queued": time.time()}) + "\n")
        log.info("policy v%d queued for the engine", version)

    @property
    def _max_batch(self) -> int:
        return self.leases_per_request * self.spec.group_size

    def _start_vllm(self) -> None:
        """Start vLLM on the run's model shape with placeholder weights (config.json only)."""
        from contrib.vllm import make_engine

        base = self.workdir / "vllm" / "base"
        base.mkdir(parents=True, exist_ok=True)
        (base / CONFIG).write_text(json.dumps(model_config(self.spec).to_hf_dict(), indent=2))
        (self.workdir / "engine.ready").unlink(missing_ok=True)
        self.engine = make_engine(
            str(base), load_format="dummy", log_path=str(self.workdir / "vllm.log"), cancel=self._vllm_cancel,
            engine={"eos_id": self.tok.eos_id, "encode": self.tok.encode, "salt": self.spec.run_id,
                    "max_concurrency": self._max_batch}, **self._vllm_settings)
        # One short request first: vLLM's first batch is several times slower than the next (measured
        # 2.4 s vs 0.35 s for 32 requests), and a node should take leases only once it is warm.
        self.engine.generate([Request("warm-up", [self.tok.bos_id] * 8, SamplingParams(temperature=1.0,
                                                                                       max_new_tokens=8))])
        (self.workdir / "engine.ready").write_text(self.engine.server.url + "\n")
        log.info("vLLM engine ready at %s", self.engine.server.url)

    def _load_vllm(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Write `version` as an HF checkpoint and load it in place (sequences in flight are kept, or
        rerun by the adapter where vLLM recomputed their KV under the new weights)."""
        root = self.workdir / "vllm"
        self.engine.load_weights(write_hf_checkpoint(state, self.spec, root / f"v{version}"), version)
        written = sorted((int(d.name[1:]) for d in root.glob("v*") if d.name[1:].isdigit()), reverse=True)
        for old in written[VLLM_CHECKPOINTS_KEPT:]:
            shutil.rmtree(root / f"v{old}", ignore_errors=True)

    async def _one_round(self, client: CoordinatorClient) -> None:
        try:
            grants = await client.lease(self.leases_per_request, holds_version=self._newest_loaded)
        except Refused as exc:
            log.warning("lease refused: %s", exc)
            await asyncio.sleep(1.0)
            return
        if not grants:
            await asyncio.sleep(0.1)
            return
        groups = await asyncio.to_thread(self._roll_out, grants)
        wait = self.recipe.tool_wait_s
        for grant, group in zip(grants, groups):
            if wait <= 0:
                await self._finish(client, grant, group, 0.0)
            else:  # episodes wait on their tools concurrently while the engine starts the next round
                task = asyncio.create_task(self._finish(client, grant, group, tool_wait(grant.seed, wait)))
                self._waiting.add(task)
                task.add_done_callback(self._waiting.discard)
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
            subs = [rollouts[i * g + j].to_submission(grant.work_id, proofs[i * g + j], self.engine_kind, self.routes)
                    for j in range(g)]
            if self.cheat and self._rng.random() < 0.5:
                kind = self.cheat if self.cheat in CHEATS else self._rng.choice(CHEATS)
                subs[0] = tamper(subs[0], kind, self._newest_loaded)
            out.append(RolloutGroup(work_id=grant.work_id, rollouts=subs))
        return out

    async def _submit(self, client: CoordinatorClient, group: RolloutGroup) -> None:
        try:
            await client.submit(group)
            self.submitted += 1
        except Refused as exc:  # stale, expired, re-granted, banned: an answer, not an outage
            self.refused += 1
            log.info("work %d refused: %s", group.work_id, exc)
