"""Trainer role: the asynchronous, networked twin of `train-local`.

Warm-up first (version 0), then for each step s: take the coordinator's batch for s (only verified
work within the off-policy bound enters it, see `protocol.pipeline`), take the optimizer step,
publish version s through shardcast and have the coordinator announce it. Publication of s overlaps
gathering the batch for s+1 (with k >= 1 that batch may hold version s-1's rollouts); step s+1's
optimizer step waits for it, so no version is ever published from weights that are changing.

Invariants: the trainer never dies on data. Every unit of a batch is re-checked before it enters a
step (as the client opens it, `protocol.work.open_unit`: the signature of its submitter, the run's
group shape; then in `_open`: every token's version within `OffPolicyLedger.admissible(min_version,
s)` and not newer than s-1, token ids inside the vocabulary, a sequence the model can hold, readable
rollouts); a unit that fails is reported to the coordinator (`BatchRejects`), which takes it out of
the batch for good and strikes its submitter, and the trainer asks for the batch again, topped up.
Each step logs the work ids it trained on, so a simulation can prove that no accepted rollout was
lost or used twice. After a crash the trainer resumes from its last checkpoint, and the step it had
not finished gets the same batch again (the request is idempotent), less every unit rejected before.

With `--dp/--ep/--cp` under torchrun, rank 0 is this networked trainer and the other ranks only
compute: each step's batch goes to every rank and the step is taken by the distributed trainer
(`node.rl.parallel.world`); each version is published streamed (`node.rl.parallel.publish`): one
parameter gathered at a time into rank 0's pinned buffer, shards encoded as their ranges complete,
so no rank ever holds the whole model twice.

Router replay (recipe `router_replay`, MoE models): each submission's routed experts are decoded into
its rollout, and the step replays them when every rollout of the batch carries them; otherwise
(a vLLM node's or an older node's submission in the batch) the step routes freely, as without
replay. Each metrics row says which (`router_replay`, `routed_rollouts`).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import signal
import time
from collections import deque
from pathlib import Path

import torch

from node.engine import Engine
from node.envs.rollout import Rollout
from node.model.checkpoint import CheckpointNotWritten, recover
from node.model.errors import WeightsHashMismatch
from node.model.fill import meta_model
from node.model.routing import InvalidRoutes, RouteShape, decode_routes
from node.model.shards import CheckpointShards
from node.model.spec import DTYPES, resolve
from node.recipe import Recipe
from node.rl.advantages import group_advantages
from node.rl.batch import TrainBatch, build_batch
from node.rl.parallel.dims import ParallelDims
from node.rl.parallel.publish import publish_trainer_async
from node.rl.warmup import WarmupConfig, warm_up
from node.rl.trainer import Trainer, TrainerConfig
from node.roles.common import environment, fresh_model, model_config, router_replay, tokenizer
from node.heap import settle_heap
from protocol.client import CoordinatorClient
from protocol.errors import ProtocolError, Refused
from protocol.identity import NodeKey
from protocol.ledger import OffPolicyLedger
from protocol.messages import RolloutSubmission, RunSpec, UnitFailure
from protocol.work import AcceptedGroup, OpenedUnit, UnreadableUnit
from node.roles.relay import other_sources
from shardcast.publish import PublishOptions
from shardcast.seeding import SeedOffer
from shardcast.server import ShardServer
from shardcast.store import Store

log = logging.getLogger(__name__)

CHECKPOINT_EVERY = 20
"""Steps between trainer checkpoints by default (`join --checkpoint-every`): the resume point after a crash; the
last step is always saved, in the HF layout with the model's tokenizer files, so the trained model opens in
transformers and vLLM."""


def note_master_precision(model: torch.nn.Module, lr: float) -> str | None:
    """A warning (logged, and returned) when a one-process trainer's master weights are bf16 or fp16: AdamW's update
    (about lr an element) below half a step of that dtype vanishes in the rounding, so a run at an LLM learning rate
    keeps few of its updates (docs/shardcast.md: one step at lr 1e-6 changed 0.39% of SmolLM2's elements with a bf16
    master, 2.9% with an fp32 one). The run's dtype decides it unless `join --master-float32` (a world keeps one in
    fp32 whatever the dtype: FSDP2's mixed precision)."""
    low = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                  if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)})
    if not low:
        return None
    msg = (f"master weights in {', '.join(low)}: AdamW updates below half a {low[0]} step are lost in the rounding "
           f"(lr {lr:g}); `join --master-float32` keeps a float32 master and publishes each version in the run's dtype")
    log.warning(msg)
    return msg


def origin_server(store: Store, spec: RunSpec, host: str, port: int) -> ShardServer:
    """The trainer's shardcast origin: super-seeding when the recipe asks for it and the spec
    lists relays to spread what it hands out (`shardcast.seeding`), else serving every request."""
    copies = Recipe.of(spec).super_seed_copies
    if copies and not other_sources(spec, host, port):
        log.warning("recipe super_seed_copies=%d ignored: the spec lists no relay to spread the shards", copies)
        copies = 0
    return ShardServer(store, seed=SeedOffer(copies) if copies else None)


class UnitRejected(ProtocolError):
    """A unit of a batch the trainer cannot train on (its type, shape, versions or tokens)."""



class TrainerNode:
    def __init__(self, key: NodeKey, spec: RunSpec, bootstrap: str, workdir: Path, shardcast_port: int,
                 parallel: dict | None = None, host: str = "127.0.0.1", device: str = "cpu", store: Store | None = None,
                 micro_batch_tokens: int | None = None, checkpoint_every: int = CHECKPOINT_EVERY,
                 master_float32: bool = False):
        """`store`: the host's shardcast store (`join --store`; default WORKDIR/shardcast);
        `micro_batch_tokens`: padded tokens one forward/backward takes (the memory plan's, node/roles/memory.py;
        None: `TrainerConfig`'s default); `checkpoint_every`: steps between checkpoints, the last one always (0:
        none); `master_float32`: one process trains in float32 whatever the run's dtype and publishes each version
        cast to it (`join --master-float32`; a world keeps a float32 master anyway)."""
        self.checkpoint_every = checkpoint_every
        run_dtype = DTYPES[spec.model.dtype]
        self.master = torch.float32 if master_float32 else run_dtype
        """The dtype the one-process trainer's weights and AdamW states are kept in."""
        self.published = run_dtype if self.master != run_dtype else None
        """What each version is cast to as it is published (None: the weights' own dtype, the run's)."""
        self.key, self.spec, self.bootstrap, self.workdir = key, spec, bootstrap, workdir
        self.device = device
        """Where the trainer's model lives (`join --device`)."""
        self.host = host
        self.parallel = parallel or {}
        try:
            self.dims = ParallelDims(**self.parallel)
        except ValueError as exc:
            raise SystemExit(f"trainer parallelism {self.parallel}: {exc}") from exc
        self.port = shardcast_port
        self.tok = tokenizer(spec)
        self.model_dir = resolve(spec.model.source)
        """The HF directory the run's model came from (None: tiny-moe): checkpoints carry its tokenizer files."""
        self.env = environment(spec)
        self.recipe = Recipe.of(spec)
        self.steps = self.recipe.steps
        self.store = store or Store(workdir / "shardcast")
        self.ledger = OffPolicyLedger(spec.max_off_policy_steps)
        self.cfg = TrainerConfig.from_recipe(self.recipe, router_replay=router_replay(spec),
                                             **({"micro_batch_tokens": micro_batch_tokens} if micro_batch_tokens else {}))
        self._shape = model_config(spec)
        """The run's model shape: a unit's tokens must fit its vocabulary and positions (`_open`)."""
        self.routes = RouteShape.of(self._shape) if self.cfg.router_replay else None
        """The route shape submissions' routed experts are decoded with (None: not replayed)."""
        self._opened: dict[int, tuple[list[Rollout], list[float]]] = {}
        """Work id -> its rollouts and rewards as `_open` read them from the batch last asked for (`train_batch`
        takes them instead of reading every submission again: routes decoded, transcripts detokenised, rewards)."""
        if self.cfg.fp8 and self.dims.world > 1:
            raise SystemExit(f"recipe train_fp8 needs the one-process trainer, not {self.dims.world} ranks")

    async def run(self, stop: asyncio.Event) -> None:
        if self.dims.world == 1:
            return await self._serve(stop, None)
        if "RANK" not in os.environ:
            raise SystemExit(f"--dp/--ep/--cp need {self.dims.world} processes: launch with torchrun "
                             f"--nproc-per-node (x nodes) = {self.dims.world}")
        from node.rl.parallel.world import Leader, follow

        seed = self.recipe.seed
        if int(os.environ["RANK"]) > 0:
            # Only rank 0 decides when to stop (it must send the stop order, or ranks would hang in
            # a collective): a signal here is logged and left to rank 0, which torchrun signals too.
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, log.info, "signal %s: waiting for rank 0's stop order", sig.name)
            # only the shape: rank 0's orders say where the weights come from (its own rows of the checkpoint)
            return await asyncio.to_thread(follow, self.dims, self.cfg, seed, meta_model(model_config(self.spec), torch.float32))
        leader = await asyncio.to_thread(Leader.connect, self.dims, self.cfg, seed)
        try:
            await self._serve(stop, leader)
        finally:
            await asyncio.to_thread(leader.stop)

    async def _serve(self, stop: asyncio.Event, leader) -> None:
        server = origin_server(self.store, self.spec, self.host, self.port)
        await server.start(self.host, self.port)
        client = await CoordinatorClient.connect(self.key, self.spec, "trainer", self.bootstrap, stop,
                                                 listen=f"/ip4/{self.host}/tcp/0")
        announcing: asyncio.Task | None = None  # the last version's announcement
        finishing: deque[asyncio.Task] = deque()  # versions announced whose wire shards may still be encoding
        try:
            recover(self.workdir / "checkpoint")  # a swap a crash cut (`written_whole`)
            directory = self._pretrained_start()
            if leader is not None and directory is not None:  # every rank reads its own rows of the checkpoint
                trainer = await asyncio.to_thread(self._start_from_checkpoint, leader, directory)
            else:
                trainer = await asyncio.to_thread(self._resume_or_warm_up)
                if leader is not None:  # every rank starts from rank 0's warmed-up or resumed trainer
                    trainer = await asyncio.to_thread(leader.start, trainer)
            if leader is None:
                note_master_precision(trainer.model, self.cfg.lr)
            settle_heap()  # the model and optimizer are built: full collector passes no longer walk them mid-step
            await self._send_weights(client, trainer)
            metrics = (self.workdir / "metrics.jsonl").open("a")
            while trainer.step < self.steps and not stop.is_set():
                step = trainer.step + 1
                t0 = time.time()
                # Version step-1 is still being published while this batch is gathered: with k >= 1 the
                # batch may hold rollouts of version step-2, so publication leaves the critical path
                # (with k = 0 the batch waits for it anyway).
                items = await self._batch(client, stop, step)
                if items is None:
                    break
                t_wait = time.time() - t0
                # The weights were copied out of the model when that publication started: this step trains
                # while the version before is still encoded and announced.
                row = await asyncio.to_thread(self._train, trainer, step, items)
                t_trained = time.time()
                if announcing is not None:
                    await announcing  # versions are listed and announced in order (and its payload buffer freed)
                while len(finishing) > 1:  # the one before may still be encoding its wire shards, not two
                    await finishing.popleft()
                row.update(wait_s=t_wait, publish_wait_s=time.time() - t_trained, t_trained=t_trained,
                           tokens=sum(u.group.n_tokens for u in items), t_asked=t0)
                announcing, finished = await self._start_publication(client, trainer, row, metrics)
                finishing.append(finished)
                if self.checkpoint_every and (step % self.checkpoint_every == 0 or step == self.steps):
                    while finishing:  # first: a world's ranks run one collective at a time
                        await finishing.popleft()
                    await self._checkpoint(trainer, step)
            while finishing:
                await finishing.popleft()
            if trainer.step >= self.steps:
                (self.workdir / "done").write_text(str(trainer.step))
                try:  # the coordinator tells every member; they leave and exit 0
                    await client.end_run(trainer.step)
                except ProtocolError as exc:
                    log.warning("end of run not reported to the coordinator: %s", exc)
        except asyncio.CancelledError:
            pass
        finally:
            for task in (announcing, *finishing):
                if task is not None:
                    task.cancel()
            await client.close("trainer stopping")
            await server.stop()

    async def _checkpoint(self, trainer, step: int) -> None:  # noqa: ANN001 (Trainer or world.Leader)
        """Save the resume point; one that cannot be written (a full disk) is an error in the log, not the end of
        the run: the previous checkpoint stays whole, and every version trained is in the store."""
        t0 = time.time()
        try:
            await asyncio.to_thread(trainer.save, self.workdir / "checkpoint", self.model_dir)
        except CheckpointNotWritten as exc:
            log.error("step %d: %s", step, exc)
            return
        log.info("step %d: checkpoint written in %.1f s", step, time.time() - t0)

    def _pretrained_start(self) -> Path | None:
        """The run's checkpoint directory when a world starts from it as it is: no trainer checkpoint
        to resume, and no warm-up asked (`warmup_target` 0: a pretrained model is not re-taught)."""
        if (self.workdir / "checkpoint" / "trainer.json").exists() or self.recipe.warmup_target > 0:
            return None
        return resolve(self.spec.model.source)

    def _start_from_checkpoint(self, leader, directory: Path):  # noqa: ANN001, ANN202 (world.Leader)
        """Version 0 checked against the spec's pin (read tensor by tensor, no model built), then every
        rank fills its shards from the files: no process holds the whole model."""
        from node.model.fill import checkpoint_digest

        cfg = model_config(self.spec)
        pinned = self.spec.model.weights_hash
        if pinned is not None:
            got = checkpoint_digest(CheckpointShards(directory), cfg, DTYPES[self.spec.model.dtype])
            if got != pinned:
                raise WeightsHashMismatch(f"{directory}: version 0 hashes to {got}, the run's spec pins {pinned}")
        (self.workdir / "warmup.json").write_text(json.dumps({"warmup_steps": 0, "warmup_greedy_reward": None}))
        return leader.start_from_checkpoint(directory, meta_model(cfg, torch.float32))

    def _resume_or_warm_up(self) -> Trainer:
        trainer = self._resumed_or_warmed_up()
        if self.dims.world == 1 and self.dims.activation_checkpointing:  # a world applies it in `parallelize`
            from node.rl.parallel.apply import checkpoint_layer

            for layer in trainer.model.model.layers:
                checkpoint_layer(layer)
        return trainer

    def _resumed_or_warmed_up(self) -> Trainer:
        ckpt = self.workdir / "checkpoint"
        if (ckpt / "trainer.json").exists():
            trainer = Trainer.load(ckpt, self.cfg, run_model=model_config(self.spec), device=self.device,
                                   dtype=self.master)
            log.info("resumed from checkpoint at step %d", trainer.step)
            return trainer
        model = fresh_model(self.spec, self.device).to(self.master)  # checked in the run's dtype; float32 is exact
        warm = {"warmup_steps": 0, "warmup_greedy_reward": None}
        if self.recipe.warmup_target > 0:  # random initialisation only (a pretrained model is not re-taught)
            # a few seconds of a small model, with the CPU engine it measures greedy reward with, so on
            # the CPU; the trained weights then go back to the role's device (no copy of a large model)
            device = next(model.parameters()).device
            model = model.to("cpu")
            engine = Engine(copy.deepcopy(model), max_batch=64, eos_id=self.tok.eos_id, decode=self.tok.decode)
            warm = warm_up(model, engine, self.env, self.tok,
                           WarmupConfig(target=self.recipe.warmup_target, seed=self.recipe.seed))
            model = model.to(device)
        log.info("warm-up done: %s", warm)
        (self.workdir / "warmup.json").write_text(json.dumps(warm))
        return Trainer(model, self.cfg)

    async def _send_weights(self, client: CoordinatorClient, trainer: Trainer) -> None:
        """Publish the trainer's current version through shardcast and have the coordinator announce it
        (the one publication path: a restart re-announces a version already in the store)."""
        await (await self._start_publication(client, trainer))[1]

    def _published_form(self) -> str:
        """The FP8 mode whose tensors every version carries in its served form (node/model/served_form.py):
        the run's; `PRIMERL_PUBLISH_FORM=plain` publishes every tensor in high precision instead (the previous
        form, kept to measure against: benchmarks/served_form_device.sh)."""
        return "off" if os.environ.get("PRIMERL_PUBLISH_FORM") == "plain" else self.spec.model.fp8

    async def _start_publication(self, client: CoordinatorClient, trainer: Trainer, row: dict | None = None,
                                 metrics=None) -> tuple[asyncio.Task, asyncio.Task]:
        """Copy the current version out of the weights (streamed: a world's ranks never gather the model)
        and return two tasks: the one that announces it once it is listed beside the trainer (the next version
        may be published then), and the one that then waits for its wire shards and writes the step's metrics
        row (`t_asked`: batch asked for; `publish_s`: copied out -> listed beside the trainer and announced;
        `wire_s`: its wire shards after that; `step_s`: batch asked for -> announced; `t`: announced). The
        weights may change as soon as this returns.

        The wire shards are the publication's longest part (2.5-4.5 s of a 10 GB version on the H200 host,
        session 38): the next version is listed and announced beside them, and its own wire shards follow
        theirs (`PayloadBuffer.wire`)."""
        v, t = trainer.step, time.time()
        signed = self.store.manifest(self.spec.run_id, v)  # whole: published before a restart
        publishing = None
        if signed is None:
            publishing = await asyncio.to_thread(
                publish_trainer_async, trainer, self.store, self.key, self.spec.run_id, v, v - 1 if v > 0 else None,
                PublishOptions(keep_last=self.spec.max_off_policy_steps + 4), self._published_form(), self.published)

        async def announce() -> float:
            # announced once listed beside the trainer (roles sharing its store load it then), before the wire
            # shards peers elsewhere fetch (they ask again until those are listed too)
            done = signed if publishing is None else await asyncio.wrap_future(publishing.listed)
            await client.announce(v, done.manifest.manifest_hash())
            self.ledger.current_version = v
            return time.time()

        announcing = asyncio.create_task(announce())

        async def finish() -> None:
            listed_at = await announcing
            whole = signed if publishing is None else await asyncio.wrap_future(publishing.whole)
            if row is None:
                return
            now = time.time()
            row.update(publish_s=listed_at - t, wire_s=now - listed_at, step_s=listed_at - row["t_asked"], t=listed_at,
                       encoding=whole.manifest.encoding, wire_bytes=whole.manifest.wire_bytes,
                       raw_bytes=whole.manifest.total_bytes)
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            log.info("step %d: reward %.3f, lag max %d, waited %.2fs, announced after %.2fs (wire shards %.2fs more)",
                     row["step"], row["reward_mean"], max(row["lags"]), row["wait_s"], row["publish_s"], row["wire_s"])

        return announcing, asyncio.create_task(finish())

    async def _batch(self, client: CoordinatorClient, stop: asyncio.Event, step: int) -> list[AcceptedGroup] | None:
        want = self.spec.batch_groups
        while not stop.is_set():
            reply = await client.batch(step, want)
            if len(reply) >= want:
                units, failures = [], []
                self._opened.clear()
                for unit in reply:
                    try:
                        units.append(self._open(step, unit))
                    except UnitRejected as exc:
                        log.warning("step %d: work %d rejected: %s", step, unit.work_id, exc)
                        failures.append(UnitFailure(work_id=unit.work_id, reason=str(exc)[:500]))
                if not failures:
                    return units
                try:
                    await client.reject_units(step, failures)  # out of the batch for good; ask again
                except Refused as exc:  # not trained on either way: ask again, never die of it
                    log.error("step %d: the coordinator refused the report of %d rejected units: %s", step,
                              len(failures), exc)
                    await asyncio.sleep(1.0)
                continue
            await asyncio.sleep(0.05)
        return None

    def _open(self, step: int, unit: OpenedUnit) -> AcceptedGroup:
        """The unit as the step will train on it, or `UnitRejected` (nothing a submitter signed gets further)."""
        if isinstance(unit, UnreadableUnit):
            raise UnitRejected(f"work {unit.work_id}: {type(unit.error).__name__}: {unit.error}")
        group = unit.group
        newest = max(v for sub in group.rollouts for v, _ in sub.version_runs)
        if not self.ledger.admissible(group.min_version, step) or newest > step - 1:
            raise UnitRejected(f"work {unit.work_id} (versions {group.min_version}..{newest}) in batch {step}")
        vocab, longest = self._shape.vocab_size, self._shape.max_position_embeddings
        try:
            task = self.env.sample_task(unit.task_index)
            prompt = task.prompt_ids(self.tok)
            for sub in group.rollouts:
                if max(sub.token_ids) >= vocab:
                    raise UnitRejected(f"work {unit.work_id}: token id {max(sub.token_ids)} outside the "
                                       f"vocabulary of {vocab}")
                if len(prompt) + sub.n_tokens > longest:
                    raise UnitRejected(f"work {unit.work_id}: {len(prompt)} + {sub.n_tokens} tokens, the model "
                                       f"holds {longest}")
            self._opened[unit.work_id] = self._read(unit)
        except UnitRejected:
            raise
        except Exception as exc:  # whatever else a unit holds that the step could not read
            raise UnitRejected(f"work {unit.work_id}: unreadable: {type(exc).__name__}: {exc}") from None
        return unit

    def _read(self, unit: AcceptedGroup) -> tuple[list[Rollout], list[float]]:
        """A unit's rollouts as the step trains on them, and their rewards (`_reward`)."""
        task = self.env.sample_task(unit.task_index)
        prompt = task.prompt_ids(self.tok)
        subs = unit.group.rollouts
        return ([Rollout.from_submission(sub, task, prompt, self._routes(sub, len(prompt))) for sub in subs],
                [self._reward(task, sub) for sub in subs])

    def train_batch(self, items: list[AcceptedGroup]) -> tuple[TrainBatch, torch.Tensor]:
        """The step's batch from its rollout groups, and the rewards [groups, group size]."""
        rollouts, rewards = [], []
        for unit in items:  # as `_open` read them (a unit it did not open is read here)
            ours, theirs = self._opened.pop(unit.work_id, None) or self._read(unit)
            rollouts += ours
            rewards.append(theirs)
        r = torch.tensor(rewards)
        adv = group_advantages(r, normalize_std=True).flatten().tolist()
        return build_batch(rollouts, adv, self.tok.pad_id), r

    def _reward(self, task, sub: RolloutSubmission) -> float:
        """The reward trained on: recomputed here from the task and the transcript (as the validator
        and the rollout driver compute it), never taken from the submitter, for environments whose
        reward is cheap (`Environment.cheap_reward`); others (sandboxed code) use the verified claim's."""
        if not getattr(self.env, "cheap_reward", True):
            return sub.reward
        reward = float(self.env.reward(task, self.tok.decode(sub.token_ids)))
        if abs(reward - sub.reward) > 1e-6:
            log.warning("work %d: submitted reward %.4f, recomputed %.4f: trained on the recomputed one",
                        sub.work_id, sub.reward, reward)
        return reward

    def _routes(self, sub: RolloutSubmission, prompt_len: int) -> torch.Tensor | None:
        """The submission's routed experts [prompt + completion - 1, L, k], or None (not replayed, not
        sent, or unreadable: only possible for a unit no validator judged, and then it is not replayed)."""
        if self.routes is None or sub.routed_experts is None:
            return None
        try:
            return decode_routes(sub.routed_experts, prompt_len + sub.n_tokens - 1, self.routes, compact=True)
        except InvalidRoutes as exc:
            log.warning("work %d: routed experts unreadable (%s); trained without replay", sub.work_id, exc)
            return None

    def _train(self, trainer: Trainer, step: int, items: list[AcceptedGroup]) -> dict:
        t0 = time.perf_counter()
        batch, r = self.train_batch(items)
        t1 = time.perf_counter()
        stats = trainer.train_step(batch)
        timing = {"batch_s": t1 - t0, "update_s": time.perf_counter() - t1}  # the host's batch, then the step
        lags = [self.ledger.lag(u.group.min_version, step) for u in items]
        routed = sum(sub.routed_experts is not None for u in items for sub in u.group.rollouts)
        from node.engine.memory_plan import gpu_memory_stats

        return {**gpu_memory_stats(self.device), "step": step, "reward_mean": float(r.mean()), "lags": lags, "work_ids": [u.work_id for u in items],
                "router_replay": self.cfg.router_replay and batch.routed_experts is not None,
                "routed_rollouts": routed, "train_fp8": self.cfg.fp8, **timing, **stats}
