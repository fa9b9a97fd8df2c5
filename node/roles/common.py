"""What every role shares: the run's model and task from the spec's recipe (`node.recipe`), fetching
a policy version through shardcast, and a stop event wired to SIGINT/SIGTERM. Roles talk to the
coordinator only through `protocol.client.CoordinatorClient` (retries, re-joins, reply types).

Invariant: a role never trusts weights it did not verify (shardcast checks the trainer's signature
and every shard hash).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

import torch

from node.envs import get_env
from node.model.config import ModelConfig
from node.model.qwen3_moe import CausalLM
from node.model.tokenizer import CharTokenizer
from node.recipe import Recipe
from protocol.errors import ProtocolError
from protocol.messages import RunSpec
from shardcast.fetch import fetch_version
from shardcast.manifest import TrustedPublishers
from shardcast.store import Store

log = logging.getLogger(__name__)

def router_replay(spec: RunSpec) -> bool:
    """Whether the run asks for routed experts to travel and be replayed (and its model has MoE layers)."""
    return Recipe.of(spec).router_replay and bool(model_config(spec).moe_layer_indices)


def model_config(spec: RunSpec) -> ModelConfig:
    from node.rl.train_local import tiny_moe_config

    r = Recipe.of(spec)
    return tiny_moe_config(CharTokenizer().vocab_size, r.hidden, r.layers, r.experts, r.top_k)


def fresh_model(spec: RunSpec) -> CausalLM:
    torch.manual_seed(Recipe.of(spec).seed)
    return CausalLM(model_config(spec)).eval()


def environment(spec: RunSpec):
    return get_env(spec.environment)


def stop_on_signals() -> asyncio.Event:
    """An event set by the first SIGINT or SIGTERM (a clean shutdown follows)."""
    from protocol.client import RunStop

    stop = RunStop()  # also ended by the coordinator: the run's end (exit 0) or a ban (EXIT_BANNED)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if hasattr(signal, "SIGUSR2"):  # `kill -USR2 PID`: every asyncio task's stack to stderr (a shutdown that hangs)
        loop.add_signal_handler(signal.SIGUSR2, dump_tasks)
    return stop


def dump_tasks() -> None:
    for task in asyncio.all_tasks():
        print(f"--- {task.get_name()}: {task.get_coro()!r}", file=sys.stderr, flush=True)
        task.print_stack(file=sys.stderr)


async def fetch_policy(spec: RunSpec, store_dir: Path, version: int, expect_hash: str | None = None,
                       tries: int = 20) -> dict[str, torch.Tensor]:
    """Version `version` of the run's policy, verified (trainer's signature, shard hashes, and the
    manifest hash the coordinator announced, when given)."""
    trusted = TrustedPublishers([spec.trainer] if spec.trainer else [])
    last: Exception | None = None
    for attempt in range(tries):
        try:
            got = await fetch_version(Store(store_dir), list(spec.shardcast_sources), trusted, spec.run_id, version)
            if expect_hash is not None and got.manifest.manifest_hash() != expect_hash:
                raise ProtocolError(f"v{version}: manifest hash differs from the announced one")
            return {k: v.clone() for k, v in got.tensors().items()}
        except ProtocolError as exc:
            last = exc
            await asyncio.sleep(min(0.2 * (attempt + 1), 2.0))
    raise ProtocolError(f"could not fetch policy v{version}: {last}")

