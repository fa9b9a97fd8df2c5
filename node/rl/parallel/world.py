"""The trainer role over a torchrun world: rank 0 is the networked trainer, the other ranks compute.

Rank 0 alone talks to the network (joins the run, takes and verifies each step's batch, publishes
versions). It hands the world each piece of work as an `Order`, scattered over a gloo control
group (a `train` order carries each rank its own share of the batch, nothing more); every rank
then carries out its order with the same collectives in the same order (`TrainerRank.carry_out`).
Nothing whole stays on any rank: `start` streams rank 0's weights tensor by tensor into the
shards (or every rank reads its shards of a distributed checkpoint), `publish` streams them
tensor by tensor into rank 0's shardcast payload, `save` writes a sharded checkpoint.
`Leader` gives rank 0 the surface of `node.rl.trainer.Trainer` (`step`, `train_step`, `save`,
plus `publish`), so the role reads the same with one process or many; `follow` is what every
other rank runs.

Invariants: on rank 0 one thread issues every collective (`Leader`'s one-thread executor), so
orders, keep-alives and the stop are totally ordered; rank 0 sends an order or a keep-alive at
least every KEEPALIVE_S, and a rank that hears nothing for ORDER_TIMEOUT_S raises `LeaderLost`;
every other collective wait is bounded by COLLECTIVE_TIMEOUT_S. So a stopped rank 0 stops every
rank (the `stop` order), and a dead one leaves no rank hung for longer than those bounds.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from concurrent.futures import Future

from node.model.checkpoint import copy_companions, ensure_room
from node.model.qwen3_moe import CausalLM
from node.rl.batch import TrainBatch
from node.rl.parallel import checkpoint as dcp_checkpoint
from node.model.shards import CheckpointShards
from node.rl.parallel.apply import init_local, materialize, parallelize
from node.rl.parallel.load import read_own_shards
from node.distributed.control import (LeaderLost, ModelMismatch, KeepAlive, check_same,  # noqa: F401 (re-exported)
                                      control_group, exchange)
from node.rl.parallel.dims import ParallelDims, ParallelGroups, init_distributed, shutdown_distributed
from node.rl.parallel.publish import PayloadBuffer, Publication, Publishing, stream_publish
from node.rl.parallel.state import scatter_optimizer_state, scatter_weights
from node.rl.parallel.trainer import DistributedTrainer, RankWork, minibatch_seed, plan_world
from node.rl.trainer import Trainer, TrainerConfig
from protocol.identity import NodeKey
from protocol.model_spec import FP8Mode
from shardcast.manifest import SignedManifest
from shardcast.publish import PublishOptions
from shardcast.store import Store

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 600.0
"""Bound on any collective of the training step (a rank that died mid-step); generous for large
models on GPUs, where one step's gathers take long."""


@dataclass
class Order:
    kind: Literal["keepalive", "start", "train", "publish", "save", "stop"]
    step: int = 0
    """start: the step the trainer is at (0, or a checkpoint's)."""
    resume: bool = False
    """start: optimizer state follows the weights (a resumed one-process checkpoint)."""
    work: RankWork | None = None
    """train: this rank's share of the step (its rows and sequence slice of each minibatch)."""
    fresh: bool = False
    """start: every rank draws its own shards (`apply.init_local`): a fresh model too large to
    build whole on rank 0 (benchmarks, a run that starts from random weights)."""
    path: str | None = None
    """start: a distributed checkpoint every rank reads its shards from (instead of rank 0's
    weights); save: where every rank writes its shards."""
    checkpoint: str | None = None
    """start: an HF-layout checkpoint (the run's pretrained model) every rank reads only its own
    parameter rows from (`load.read_own_shards`): no process holds the whole model."""


class TrainerRank:
    """One rank's part of the world: its process groups and, once started, its trainer shard."""

    def __init__(self, dims: ParallelDims, cfg: TrainerConfig, seed: int, model: CausalLM | None = None,
                 optimizer_state: dict[str, dict[str, torch.Tensor]] | None = None):
        self.dims, self.cfg, self.seed = dims, cfg, seed
        self.model = model
        """Until `start`: rank 0's whole model (the weights every rank starts from); on other
        ranks a model of the same shape, only its config is read (it may live on the meta device)."""
        self.optimizer_state = optimizer_state or {}
        self.device = init_distributed(COLLECTIVE_TIMEOUT_S)
        self.rank = dist.get_rank()
        # Orders travel on CPU over gloo whatever the training backend: they are small and
        # their timeout (ORDER_TIMEOUT_S) differs from the training collectives'.
        self.control = control_group()
        self.groups = ParallelGroups.build(dims, self.device)
        if model is not None:
            dims.check_model(model.config)
        self.trainer: DistributedTrainer | None = None
        self.seen_rows: list[int] = []
        """Rows of each batch share this rank was sent (its part of the batch, then of each minibatch)."""
        self.publication: Publication | None = None
        """Rank 0, publish order: where the version goes (set by the `Leader` before the order)."""

    def exchange(self, order: Order | list[Order] | None) -> Order:
        """Rank 0 sends `order` (one for all, or one per rank); every rank receives its own."""
        return exchange(self.control, order)

    def carry_out(self, order: Order):
        """The order's work on this rank (collective: every rank runs the same)."""
        if order.kind == "start":
            return self._start(order)
        if order.kind == "train":
            self.seen_rows += [len(mb.batch) for mb in order.work.minibatches]
            return self.trainer.train_work(order.work)
        if order.kind == "publish":
            sink, self.publication = self.publication, None
            return stream_publish(self.trainer.model, self.groups, self.publish_dtype(), sink)
        if order.kind == "save":
            return dcp_checkpoint.save(self.trainer, order.path)
        return None

    def publish_dtype(self) -> torch.dtype | None:
        """bf16 when the forward computes in bf16 (what inference should run), else the weights' own."""
        return torch.bfloat16 if self.dims.mixed_precision(self.device) else None

    def _start(self, order: Order) -> None:
        """Build the model on the meta device, shard it, allocate only this rank's shards and fill
        them: from a distributed checkpoint, or tensor by tensor from rank 0's weights."""
        config = self.model.config
        check_same(self.control, config.model_dump())
        with torch.device("meta"):
            skeleton = CausalLM(config)
        model = materialize(parallelize(skeleton, self.groups), self.device)
        trainer = DistributedTrainer(model, self.groups, self.cfg, self.seed)
        if order.fresh:
            init_local(model, self.seed)
        elif order.checkpoint:
            read_own_shards(model, self.groups, CheckpointShards(order.checkpoint))
        elif order.path:
            dcp_checkpoint.load(trainer, order.path)
        else:
            source = dict(self.model.named_parameters()) if self.rank == 0 else None
            scatter_weights(model, self.groups, source)
            trainer.step = order.step
            if order.resume:
                scatter_optimizer_state(model, trainer.optimizer, self.groups,
                                        self.optimizer_state if self.rank == 0 else None)
        self.model, self.optimizer_state = None, {}  # the trainer owns the weights now
        self.trainer = trainer

    def close(self) -> None:
        shutdown_distributed(timeout_s=10.0)  # a peer that died is not waited for long


def follow(dims: ParallelDims, cfg: TrainerConfig, seed: int, model: CausalLM, on_stop=None) -> None:
    """What ranks > 0 run: carry out rank 0's orders until it sends `stop` (raises `LeaderLost`
    when it goes silent). `model` gives the run's shape (its weights are not used: it may be on
    the meta device). `on_stop(rank)`: called before leaving (benchmarks read the rank's memory)."""
    rank = TrainerRank(dims, cfg, seed, model)
    log.info("rank %d of %d: following rank 0 (%s)", rank.rank, dims.world, dims)
    try:
        while True:
            order = rank.exchange(None)
            if order.kind == "stop":
                log.info("rank %d: stop from rank 0 at step %s", rank.rank,
                         rank.trainer.step if rank.trainer else "-")
                if on_stop is not None:
                    on_stop(rank)
                return
            rank.carry_out(order)
    finally:
        rank.close()


class Leader:
    """Rank 0's trainer: `Trainer`'s surface over the whole world. It holds no weights itself:
    `publish` and `save` have every rank stream or write its shards."""

    def __init__(self, rank: TrainerRank, collectives: ThreadPoolExecutor):
        self.rank, self.cfg = rank, rank.cfg
        self.collectives = collectives
        self.step = 0
        self.buffer = PayloadBuffer()
        self.last_publish: dict[str, float] = {}
        """Timings of the last publication: gather_s (the world busy), total_s (listed beside the publisher)."""
        self._stopped = False  # touched only on the collectives thread
        self._closing = threading.Event()
        self._keepalive = KeepAlive(lambda: self.collectives.submit(self._send, Order("keepalive")))

    @classmethod
    def connect(cls, dims: ParallelDims, cfg: TrainerConfig, seed: int, model: CausalLM | None = None) -> "Leader":
        """Join the torchrun world as rank 0 (blocking: waits for every rank)."""
        collectives = ThreadPoolExecutor(1, thread_name_prefix="collectives")
        rank = collectives.submit(TrainerRank, dims, cfg, seed, model).result()
        if rank.rank != 0:
            raise RuntimeError(f"Leader.connect on rank {rank.rank}")
        log.info("rank 0 of %d: leading (%s)", dims.world, dims)
        return cls(rank, collectives)

    @property
    def trainer(self) -> DistributedTrainer:
        """Rank 0's shard of the distributed trainer (touch only from the collectives thread)."""
        return self.rank.trainer

    def _send(self, order: Order | list[Order]):
        first = order[0] if isinstance(order, list) else order
        if self._stopped:
            return None
        self._stopped = first.kind == "stop"
        mine = self.rank.exchange(order)
        self._keepalive.sent()
        return self.rank.carry_out(mine)

    def _order(self, order: Order | list[Order]):
        return self.collectives.submit(self._send, order).result()

    def start(self, trainer: Trainer) -> "Leader":
        """Every rank starts from `trainer` (warmed up, or resumed: weights, AdamW state, step);
        a `Trainer` loaded from a distributed checkpoint has every rank read its own shards."""
        path = getattr(trainer, "distributed_checkpoint", None)
        self.rank.model = trainer.model  # its config (and, without a distributed checkpoint, its weights)
        if path is not None:
            self._order(Order("start", step=trainer.step, path=str(path)))
        else:
            names = {id(p): n for n, p in trainer.model.named_parameters()}
            self.rank.optimizer_state = {names[id(p)]: s for p, s in trainer.optimizer.state.items()}
            self._order(Order("start", step=trainer.step, resume=bool(self.rank.optimizer_state)))
        self.step = self.rank.trainer.step
        return self

    def start_from_checkpoint(self, directory: str | Path, model: CausalLM | None = None) -> "Leader":
        """Every rank reads its own shards of the HF-layout checkpoint `directory` (version 0 of a
        pretrained run); `model` (meta is enough) or the one given to `connect` gives the shape."""
        if model is not None:
            self.rank.model = model
        self._order(Order("start", checkpoint=str(directory)))
        self.step = self.rank.trainer.step
        return self

    def start_fresh(self) -> "Leader":
        """Every rank draws its own shards of a fresh model (the model given to `connect`)."""
        self._order(Order("start", fresh=True))
        return self

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One step; each rank gets only its share of `batch` (planned here, scattered)."""
        works = plan_world(batch, self.rank.dims, self.cfg, minibatch_seed(self.rank.seed, self.step))
        metrics = self._order([Order("train", work=w) for w in works])
        self.step += 1
        return metrics

    def send_weights_async(self, store: Store, key: NodeKey, run_id: str, version: int, parent: int | None,
                      options: PublishOptions | None = None, fp8: FP8Mode = "off") -> Publishing:
        """Stream the weights into `store` as `version`. Returns once the world has gathered them
        (the next order, e.g. the next step, may run while rank 0 encodes): its `listed` Future gets the
        local SignedManifest (timings written), its `whole` one the whole manifest."""
        done: Future = Future()  # set by rank 0's publication sink
        whole: Future = Future()
        signed: Future = Future()  # what the caller gets: resolved only once the timings are written
        started = time.perf_counter()
        timings: dict[str, float] = {}

        def stamp(f: Future) -> None:
            # a done-callback runs after result() has already woken its waiters, so the caller's
            # Future must not be `done` itself: a reader of last_publish could miss total_s
            timings["total_s"] = time.perf_counter() - started
            if f.cancelled():
                signed.cancel()
            elif f.exception() is not None:
                signed.set_exception(f.exception())
            else:
                signed.set_result(f.result())

        done.add_done_callback(stamp)

        def send() -> float:
            self.rank.publication = Publication(store, key, run_id, version, parent, options, self.buffer, done, whole,
                                                fp8)
            return self._send(Order("publish"))

        timings["gather_s"] = self.collectives.submit(send).result()
        self.last_publish = timings
        return Publishing(signed, whole)

    def send_weights(self, store: Store, key: NodeKey, run_id: str, version: int, parent: int | None,
                options: PublishOptions | None = None, fp8: FP8Mode = "off") -> SignedManifest:
        return self.send_weights_async(store, key, run_id, version, parent, options, fp8).whole.result()

    def save(self, directory: str | Path, companions_from: str | Path | None = None) -> Path:
        """A distributed checkpoint: every rank writes its shards of the weights and AdamW state
        (`checkpoint.save`: beside the previous one, which goes once the new one is pointed at); `Trainer.load`
        on it resumes one process, `start` any layout. `CheckpointDoesNotFit` before any rank writes when the
        directory's filesystem has not the room for the whole of it (the ranks' shards together; a full disk
        mid-write failed the world's collective). `companions_from`: the model directory whose tokenizer files
        are copied beside it."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        need = self.collectives.submit(self._checkpoint_bytes).result()
        ensure_room(directory, need, what=f"distributed checkpoint {directory}")
        self._order(Order("save", path=str(directory)))
        if companions_from is not None:
            copy_companions(companions_from, directory)
        return Path(directory)

    def _checkpoint_bytes(self) -> int:
        """The whole model's weights and two AdamW moments of each (a sharded parameter counts its global size)."""
        return 3 * sum(p.numel() * p.element_size() for p in self.trainer.model.parameters())

    def stop(self) -> None:
        """Every rank leaves (idempotent); waits for an order in flight to finish first."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._keepalive.close()
        try:
            self._order(Order("stop"))
        except RuntimeError as exc:  # a rank already gone: nothing left to stop
            log.warning("stop order not delivered: %s", exc)
        self.collectives.submit(self.rank.close).result()
        self.collectives.shutdown()
