"""The trainer role over a torchrun world: rank 0 is the networked trainer, the other ranks compute.

Rank 0 alone talks to the network (joins the run, takes and verifies each step's batch, publishes
versions). It hands the world each piece of work as an `Order`, broadcast over a gloo control
group; every rank then carries out the same order with the same collectives in the same order
(`TrainerRank.carry_out`), and rank 0 keeps what the order returns: the whole parameters after a
step (to publish), the whole optimizer state (to checkpoint). `Leader` gives rank 0 the surface of
`node.rl.trainer.Trainer` (`step`, `model`, `train_step`, `save`), so the role reads the same with
one process or many; `follow` is what every other rank runs.

Invariants: on rank 0 one thread issues every collective (`Leader`'s one-thread executor), so
orders, keep-alives and the stop are totally ordered; rank 0 sends an order or a keep-alive at
least every KEEPALIVE_S, and a rank that hears nothing for ORDER_TIMEOUT_S raises `LeaderLost`;
every other collective wait is bounded by COLLECTIVE_TIMEOUT_S. So a stopped rank 0 stops every
rank (the `stop` order), and a dead one leaves no rank hung for longer than those bounds.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from node.model.qwen3_moe import CausalLM
from node.rl.batch import TrainBatch
from node.rl.parallel.apply import parallelize
from node.rl.parallel.dims import ParallelDims, ParallelGroups, init_distributed, shutdown_distributed
from node.rl.parallel.state import MOMENTS, full_optimizer_state, load_optimizer_state
from node.rl.parallel.trainer import DistributedTrainer
from node.rl.trainer import Trainer, TrainerConfig

log = logging.getLogger(__name__)

KEEPALIVE_S = 10.0
"""Rank 0 sends a keep-alive when it has sent no order for this long (waiting for a batch, warm-up)."""
ORDER_TIMEOUT_S = 120.0
"""A rank that hears nothing from rank 0 for this long (12 missed keep-alives) gives up."""
COLLECTIVE_TIMEOUT_S = 600.0
"""Bound on any collective of the training step (a rank that died mid-step); generous for large
models on GPUs, where one step's gathers take long."""


class LeaderLost(RuntimeError):
    """Rank 0 sent nothing (no order, no keep-alive) within ORDER_TIMEOUT_S: it is gone."""


@dataclass
class Order:
    kind: Literal["keepalive", "start", "train", "save", "stop"]
    step: int = 0
    """start: the step the trainer is at (0, or a checkpoint's)."""
    resume: bool = False
    """start: optimizer state follows the weights (a resumed checkpoint)."""
    batch: TrainBatch | None = None
    """train: the whole batch (every rank takes its shard of each minibatch)."""


class TrainerRank:
    """One rank's part of the world: its process groups and, once started, its trainer shard."""

    def __init__(self, dims: ParallelDims, cfg: TrainerConfig, seed: int, model: CausalLM | None = None,
                 optimizer_state: dict[str, dict[str, torch.Tensor]] | None = None):
        self.dims, self.cfg, self.seed = dims, cfg, seed
        self.model = model
        """Whole, unsharded, until `start`: rank 0's holds the weights every rank starts from; the
        others' (a model of the same shape) are overwritten by them."""
        self.optimizer_state = optimizer_state or {}
        self.device = init_distributed(COLLECTIVE_TIMEOUT_S)
        self.rank = dist.get_rank()
        # Orders travel on CPU over gloo whatever the training backend: they are small and
        # their timeout (ORDER_TIMEOUT_S) differs from the training collectives'.
        self.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=ORDER_TIMEOUT_S))
        self.groups = ParallelGroups.build(dims, self.device)
        self.trainer: DistributedTrainer | None = None

    def exchange(self, order: Order | None) -> Order:
        """Rank 0 sends `order`; every other rank receives it (None) and gets it back."""
        box = [order]
        try:
            dist.broadcast_object_list(box, src=0, group=self.control)
        except RuntimeError as exc:
            if self.rank == 0:
                raise
            raise LeaderLost(f"rank {self.rank}: nothing from rank 0 within {ORDER_TIMEOUT_S:.0f}s ({exc})") from exc
        return box[0]

    def carry_out(self, order: Order):
        """The order's work on this rank (collective: every rank runs the same)."""
        if order.kind == "start":
            return self._start(order)
        if order.kind == "train":
            metrics = self.trainer.train_step(order.batch)
            return metrics, self.trainer.full_parameters()
        if order.kind == "save":
            return full_optimizer_state(self.trainer)
        return None

    def _start(self, order: Order) -> None:
        """Rank 0's weights (and optimizer state on resume) to every rank, then shard."""
        with torch.no_grad():
            for _, t in sorted(self.model.state_dict().items()):
                dist.broadcast(t, src=0, group=self.control)
        state = {}
        if order.resume:
            for name, p in sorted(self.model.named_parameters()):
                mine = self.optimizer_state.get(name, {})
                entry = {k: mine[k].clone() if k in mine else torch.zeros_like(p) for k in MOMENTS}
                entry["step"] = mine["step"].clone().float() if "step" in mine else torch.zeros(())
                for k in (*MOMENTS, "step"):
                    dist.broadcast(entry[k], src=0, group=self.control)
                state[name] = entry
        model = parallelize(self.model.to(self.device), self.groups)
        self.model = None  # parallelize rewired it in place: the trainer owns it now
        self.trainer = DistributedTrainer(model, self.groups, self.cfg, self.seed)
        self.trainer.step = order.step
        load_optimizer_state(self.trainer, state)

    def close(self) -> None:
        shutdown_distributed(timeout_s=10.0)  # a peer that died is not waited for long


def follow(dims: ParallelDims, cfg: TrainerConfig, seed: int, model: CausalLM) -> None:
    """What ranks > 0 run: carry out rank 0's orders until it sends `stop` (raises `LeaderLost`
    when it goes silent). `model` is a model of the run's shape; rank 0's weights replace its own."""
    rank = TrainerRank(dims, cfg, seed, model)
    log.info("rank %d of %d: following rank 0 (%s)", rank.rank, dims.world, dims)
    try:
        while True:
            order = rank.exchange(None)
            if order.kind == "stop":
                log.info("rank %d: stop from rank 0 at step %s", rank.rank,
                         rank.trainer.step if rank.trainer else "-")
                return
            rank.carry_out(order)
    finally:
        rank.close()


class Leader:
    """Rank 0's trainer: `Trainer`'s surface over the whole world. `model` is a whole, unsharded
    copy of the weights after the last step (what the role publishes)."""

    def __init__(self, rank: TrainerRank, collectives: ThreadPoolExecutor):
        self.rank, self.cfg = rank, rank.cfg
        self.collectives = collectives
        self.model: CausalLM | None = None
        self.step = 0
        self._last_order = time.monotonic()
        self._stopped = False  # touched only on the collectives thread
        self._closing = threading.Event()
        threading.Thread(target=self._keep_alive, name="keepalive", daemon=True).start()

    @classmethod
    def connect(cls, dims: ParallelDims, cfg: TrainerConfig, seed: int) -> "Leader":
        """Join the torchrun world as rank 0 (blocking: waits for every rank)."""
        collectives = ThreadPoolExecutor(1, thread_name_prefix="collectives")
        rank = collectives.submit(TrainerRank, dims, cfg, seed).result()
        if rank.rank != 0:
            raise RuntimeError(f"Leader.connect on rank {rank.rank}")
        log.info("rank 0 of %d: leading (%s)", dims.world, dims)
        return cls(rank, collectives)

    def _send(self, order: Order):
        if self._stopped:
            return None
        self._stopped = order.kind == "stop"
        self.rank.exchange(order)
        self._last_order = time.monotonic()
        return self.rank.carry_out(order)

    def _order(self, order: Order):
        return self.collectives.submit(self._send, order).result()

    def _keep_alive(self) -> None:
        while not self._closing.wait(KEEPALIVE_S / 4):
            if time.monotonic() - self._last_order >= KEEPALIVE_S:
                self._last_order = time.monotonic()  # one queued keep-alive at a time
                try:
                    self.collectives.submit(self._send, Order("keepalive"))
                except RuntimeError:  # stop() shut the executor down meanwhile
                    return

    def start(self, trainer: Trainer) -> "Leader":
        """Every rank starts from `trainer` (warmed up, or resumed: weights, AdamW state, step)."""
        self.model = copy.deepcopy(trainer.model).eval()
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        self.rank.optimizer_state = {names[id(p)]: s for p, s in trainer.optimizer.state.items()}
        self.rank.model = trainer.model
        self._order(Order("start", step=trainer.step, resume=bool(self.rank.optimizer_state)))
        self.step = trainer.step
        return self

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        metrics, params = self._order(Order("train", batch=batch))
        own = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in params.items():
                own[name].copy_(t)
        self.step += 1
        return metrics

    def save(self, directory: str | Path) -> Path:
        """A `Trainer` checkpoint (rank 0 writes it; `Trainer.load` reads it)."""
        state = self._order(Order("save"))
        whole = Trainer(self.model, self.cfg)
        whole.step = self.step
        for name, p in self.model.named_parameters():
            if float(state[name]["step"]) > 0:
                whole.optimizer.state[p] = state[name]
        return whole.save(directory)

    def stop(self) -> None:
        """Every rank leaves (idempotent); waits for an order in flight to finish first."""
        if self._closing.is_set():
            return
        self._closing.set()
        try:
            self._order(Order("stop"))
        except RuntimeError as exc:  # a rank already gone: nothing left to stop
            log.warning("stop order not delivered: %s", exc)
        self.collectives.submit(self.rank.close).result()
        self.collectives.shutdown()
