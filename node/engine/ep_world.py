"""The inference role over an expert-parallel world (`join --role inference --ep N`): rank 0 is the
network node, every rank serves its own sequences and holds 1/N of every MoE layer's experts.

Rank 0 alone talks to the network (leases, weight fetch through shardcast, proofs, submissions). Its
engine, `EPLeader`, has the built-in engine's surface (`add_request`, `has_work`, `step`,
`load_weights`, `generate`), so the role drives it as any engine. Each `step()` is one `EPOrder` per
rank, scattered over the gloo control group (`node.distributed.control`, the trainer's channel too):
the requests newly given to that rank (attention is data-parallel: a request runs wholly on the rank
it was given to, the least loaded), and the policy version to switch to, if one is pending. Every rank
then (1) receives that version from rank 0 (`EPEngine.receive_version`: replicated tensors broadcast,
each rank scattered only its experts' rows), (2) runs one `EPEngine.step()` (prefill and decode, with
the all-to-alls of every MoE layer), and (3) sends rank 0 the completions it finished (tokens,
logprobs, versions, hidden states, routes), which rank 0 returns as its own. `follow` is what every
other rank runs.

Invariants: on rank 0 one thread issues every collective (orders, keep-alives, stop), so they are
totally ordered; a version is switched inside a step order, before that step's forward, on every rank
(no token of a step mixes versions across ranks); a version that does not fit the model is refused
on rank 0 before any order carries it (every rank keeps the last good one). A rank that dies makes
rank 0's next order fail with `EPRankLost`; a rank 0 that dies or stops ends every other rank
(`LeaderLost`, or the `stop` order).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from node.engine.core import Completion, Request, RequestQueue
from node.engine.ep import EPEngine
from node.engine.registry import EngineSetup, EngineUnavailable
from node.distributed.control import KeepAlive, check_same, control_group, exchange
from node.distributed.world import shutdown_distributed

log = logging.getLogger(__name__)

STEP_TIMEOUT_S = 300.0
"""Bound on any collective of a step (the all-to-alls, the weight transfer): a rank that died mid-step."""
WATCH_S = 0.25
"""While an order is in flight, rank 0 looks this often whether a rank `join` started has exited: a
dead rank stops the node at once, not when (or if) gloo notices its closed socket."""


class EPRankLost(RuntimeError):
    """A rank of the expert-parallel world failed or went away mid-run: rank 0 stops the node."""


class EPWorldStopped(RuntimeError):
    """A step asked of rank 0's engine after `close()` (a roll-out thread outliving its node)."""


@dataclass
class EPOrder:
    kind: Literal["keepalive", "step", "stop"]
    requests: list[Request] = field(default_factory=list)
    """step: requests given to this rank since the last step."""
    version: int | None = None
    """step: switch to this policy version (received from rank 0) before the step's forward."""


def check(setup: EngineSetup) -> dict:
    """Refuse what the expert-parallel engine cannot serve, before any process starts."""
    experts = int(setup.hf_config.get("num_experts") or 0)
    if setup.options:
        raise EngineUnavailable(f"engine builtin-ep takes no options ({', '.join(setup.options)})")
    if setup.fp8 != "off":
        raise EngineUnavailable("engine builtin-ep serves without FP8 (--fp8 is builtin-cuda's)")
    if setup.ep < 2:
        raise EngineUnavailable(f"engine builtin-ep needs --ep >= 2 processes, not {setup.ep}")
    if not experts:
        raise EngineUnavailable(f"--ep {setup.ep}: the run's model is dense (no experts to split)")
    if experts % setup.ep:
        raise EngineUnavailable(f"--ep {setup.ep} must divide the model's {experts} experts")
    return {"ep": setup.ep, "device": setup.device}


def use_device(device: str) -> None:
    """Make `device` current in the calling thread (a CUDA device is per thread; NCCL and the engine's
    kernels launch on the current one)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))


class Collectives:
    """The one thread of rank 0 that issues every collective, in submission order. A daemon thread, not
    a pool's worker: after a rank dies the thread may stay blocked in a collective that never returns,
    and neither `close()` nor the process's exit may wait for it."""

    def __init__(self, device: str):
        self._orders: queue.SimpleQueue = queue.SimpleQueue()
        self.current: Future | None = None
        """The order submitted last (done once the thread is free)."""
        self._shut = False
        threading.Thread(target=self._run, args=(device,), name="ep-collectives", daemon=True).start()

    def submit(self, fn, *args) -> Future:  # noqa: ANN001
        if self._shut:
            raise RuntimeError("the collectives thread was shut down")
        future: Future = Future()
        self.current = future
        self._orders.put((future, fn, args))
        return future

    def idle(self) -> bool:
        return self.current is None or self.current.done()

    def shutdown(self) -> None:
        self._shut = True
        self._orders.put(None)

    def _run(self, device: str) -> None:
        use_device(device)
        while (item := self._orders.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                future.set_exception(exc)


class EPRank:
    """One process of the world: its process groups and its share of the engine."""

    def __init__(self, setup: EngineSetup):
        use_device(setup.device)
        backend = "nccl" if setup.device.startswith("cuda") else "gloo"
        if not dist.is_initialized():  # env:// rendezvous: set by torchrun or by `join` (node.engine.ep_spawn)
            dist.init_process_group(backend, timeout=timedelta(seconds=STEP_TIMEOUT_S))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != setup.ep:
            raise EngineUnavailable(f"--ep {setup.ep} but the world has {self.world} processes")
        self.control = control_group()
        model = setup.model()
        check_same(self.control, {**model.config.model_dump(), "dtype": str(next(model.parameters()).dtype),
                                  "max_batch": setup.max_batch, "max_seq_len": setup.max_seq_len})
        self.engine = EPEngine(model, **setup.engine_kwargs())

    def carry_out(self, order: EPOrder, version: dict[str, torch.Tensor] | None = None) -> list[list[Completion]] | None:
        """The order's work on this rank (collective). Rank 0 passes the checked version to send and
        gets every rank's finished completions back."""
        if order.kind != "step":
            return None
        for r in order.requests:
            self.engine.add_request(r)
        if order.version is not None:
            self.engine.receive_version(order.version, version if self.rank == 0 else None)
        done = self.engine.step()
        everyone: list | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(done, everyone, dst=0, group=self.control)
        return everyone

    def close(self, wait_s: float = 10.0) -> None:
        shutdown_distributed(timeout_s=wait_s)  # a peer that died is not waited for long


def follow(setup: EngineSetup) -> None:
    """What ranks > 0 run: carry out rank 0's orders until it sends `stop` (`LeaderLost` when it goes)."""
    rank = EPRank(setup)
    log.info("expert-parallel rank %d of %d: following rank 0", rank.rank, rank.world)
    try:
        while True:
            order = exchange(rank.control, None)
            if order.kind == "stop":
                log.info("rank %d: stop from rank 0", rank.rank)
                return
            rank.carry_out(order)
    finally:
        rank.close()


class EPLeader(RequestQueue):
    """Rank 0's engine: the built-in engine's surface over the whole world."""

    def __init__(self, rank: EPRank, collectives: Collectives):
        super().__init__(rank.engine.max_seq_len, version=-1)  # `waiting`: requests not yet given to a rank
        self.rank, self.collectives = rank, collectives
        self.running: dict[str, int] = {}
        """Request id -> the rank serving it."""
        self._stopped = False  # touched only on the collectives thread
        self._broken = False
        self._closing = threading.Event()
        self.served = [0] * rank.world
        """Requests given to each rank so far."""
        self._keepalive = KeepAlive(lambda: self.collectives.submit(self._send, [EPOrder("keepalive")] * rank.world))

    check = staticmethod(check)  # what `registry.check` calls before anything starts

    @classmethod
    def from_setup(cls, setup: EngineSetup) -> EPLeader:
        """The registry's factory (`builtin-ep`): join the world as rank 0 (blocking: waits for every rank)."""
        check(setup)
        if int(os.environ.get("RANK", "0")) != 0:
            raise EngineUnavailable("the expert-parallel leader is rank 0; other ranks run ep_world.follow")
        rank = _form_world(setup)
        collectives = Collectives(setup.device)
        log.info("expert-parallel rank 0 of %d: leading (%d of %d experts per rank)", rank.world,
                 rank.engine.model.config.num_experts // rank.world, rank.engine.model.config.num_experts)
        return cls(rank, collectives)

    @property
    def ep(self) -> int:
        return self.rank.world

    def step(self) -> list[Completion]:
        """Give the waiting requests to the least loaded ranks, and the pending version (every rank switches
        to it before this step's forward); one step on every rank; every rank's finished completions."""
        pending = self._pending.take()
        checked = None
        if pending is not None:  # checked before any order carries it: a refused version changes nothing anywhere
            checked = self.rank.engine.check_version(pending[0])
        load = [0] * self.ep
        for r in self.running.values():
            load[r] += 1
        orders = [EPOrder("step", version=None if pending is None else pending[1]) for _ in range(self.ep)]
        while self.waiting:
            r = min(range(self.ep), key=lambda i: (load[i], i))
            request = self.waiting.popleft()
            orders[r].requests.append(request)
            self.running[request.request_id] = r
            load[r] += 1
            self.served[r] += 1
        everyone = self._order(orders, checked)
        if everyone is None:  # the stop order went out first (close() raced this step)
            raise EPWorldStopped("the expert-parallel world was stopped")
        if pending is not None:
            self.version = pending[1]
        done = [c for part in everyone for c in part]
        for c in done:
            del self.running[c.request_id]
        self.tokens_generated = self.rank.engine.tokens_generated
        return done

    def _send(self, orders: list[EPOrder], version: dict[str, torch.Tensor] | None = None):
        if self._stopped:
            return None
        self._stopped = orders[0].kind == "stop"
        mine = exchange(self.rank.control, orders)
        self._keepalive.sent()
        return self.rank.carry_out(mine, version)

    def _order(self, orders: list[EPOrder], version: dict[str, torch.Tensor] | None = None):
        from node.engine.ep_spawn import started

        if self._closing.is_set() and orders[0].kind != "stop":
            raise EPWorldStopped("the expert-parallel world was stopped")
        future, followers = self.collectives.submit(self._send, orders, version), started()
        while True:
            try:
                return future.result(timeout=WATCH_S)
            except TimeoutError:  # still in flight: is every rank alive?
                gone = followers.exited() if followers is not None else {}
                if gone:
                    self._broken = True
                    raise EPRankLost(f"expert-parallel world of {self.ep} broken ({_which(gone)}): "
                                     f"the {orders[0].kind} order was in flight") from None
            except RuntimeError as exc:  # gloo/NCCL: a peer's socket closed, or a collective timed out
                self._broken = True
                gone, deadline = {}, time.monotonic() + 1.0  # a killed rank's sockets close a moment before it can be reaped
                while followers is not None and time.monotonic() < deadline:
                    gone = followers.exited()
                    if gone:
                        break
                    time.sleep(0.05)
                raise EPRankLost(f"expert-parallel world of {self.ep} broken ({_which(gone)}): {exc}") from exc

    def close(self) -> None:
        """Every rank leaves (idempotent; a world already broken is left as it is)."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._keepalive.close()
        log.info("expert-parallel world stopping: requests served per rank %s", self.served)
        if not self._broken:
            try:
                self._order([EPOrder("stop")] * self.ep)
            except EPRankLost as exc:
                log.warning("stop order not delivered: %s", exc)
        # a broken world has no peer to wait for: leave at once, and not at all while the collectives
        # thread is still blocked in an order a dead rank never answers (the process exits without it)
        if self.collectives.idle():
            try:
                self.collectives.submit(self.rank.close, 0.0 if self._broken else 10.0).result(timeout=30.0)
            except TimeoutError:
                log.warning("expert-parallel world: leaving the process group took over 30 s; not waiting")
        else:
            log.warning("expert-parallel world: its collectives thread is blocked on a lost rank; left as it is")
        self.collectives.shutdown()


def _which(gone: dict[int, int]) -> str:
    return "; ".join(f"rank {r} exited with code {c}" for r, c in gone.items()) or "a rank failed"


def _form_world(setup: EngineSetup) -> EPRank:
    """Rank 0's `EPRank`, formed while watching the ranks `join` started: one that exits first (a bad
    device, an import error) fails the start at once instead of leaving rank 0 waiting out the
    rendezvous (STEP_TIMEOUT_S). The wait runs in a daemon thread, which an exiting node never waits for."""
    from node.engine.ep_spawn import started

    box: dict = {}

    def form() -> None:
        try:
            box["rank"] = EPRank(setup)
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=form, name="ep-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
        followers = started()
        gone = followers.exited() if followers is not None else {}
        if gone and thread.is_alive():
            r, code = next(iter(gone.items()))
            raise EngineUnavailable(f"expert-parallel rank {r} exited (code {code}) before the world formed; "
                                    f"see {followers.logs[r]}")
        if setup.cancel.is_set() and thread.is_alive():
            raise EngineUnavailable("the node stopped while its expert-parallel world formed")
    if "error" in box:
        raise box["error"]
    return box["rank"]
