"""`primerl-node model pin SOURCE`: the `[model]` table of run.toml for a checkpoint, its weights hash pinned;
`primerl-node model plan`: what each role of a run would hold on a device of a given size, before joining.

A run's members refuse to start on weights other than the ones its spec pins (`ModelSpec.weights_hash`),
but only if the operator pins them. This prints the table to paste: the checkpoint checked from its
headers first (config.json, every shard the index lists, every tensor's name and shape, FP8 scales: a bad
one is one line and exit 2), then hashed as every member will hash version 0 in the run's dtype, one
tensor at a time (no model is built: host memory stays at one tensor, so a 30B checkpoint pins on a
small machine; the time is a read of the checkpoint, plus dequantisation for an FP8 one).

    primerl-node model pin /models/Qwen3-30B-A3B-FP8 [--dtype bfloat16] [--max-seq-len 4096] >> run.toml

`model plan` reads the run's spec (`--spec STATE/spec.json`, what the operator hands out, or `--config
run.toml`) and prints each role's memory plan (`node.roles.memory.role_plan`, what `join` prints and checks
first) against `--free-gib` (the device's memory, which need not be on this machine): exit 2 when a role
asked for does not fit, naming the numbers. Only config.json is read.

    primerl-node model plan --spec spec.json --device cuda --free-gib 139 [--role inference] [--dp 8]
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import get_args

from protocol.model_spec import DType, ModelSpec

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="a checkpoint's [model] table for run.toml, its weights hash pinned")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    pin = verbs.add_parser("pin", help="check a checkpoint and print its [model] table with weights_hash",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pin.add_argument("source", help="the checkpoint's HF-layout directory, or a registry name (smollm2-135m-instruct)")
    pin.add_argument("--dtype", choices=get_args(DType), default=None,
                     help="the run's weight dtype (default: bfloat16 for a checkpoint); the hash is of the weights in it")
    pin.add_argument("--max-seq-len", type=int, default=ModelSpec.model_fields["max_seq_len"].default,
                     help="longest prompt + completion any role runs (the spec's model.max_seq_len)")
    pin.set_defaults(func=run_pin)
    plan = verbs.add_parser("plan", help="each role's memory plan for a run on a device of --free-gib, before joining")
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--spec", type=Path, help="the run's spec (the coordinator's STATE/spec.json)")
    source.add_argument("--config", type=Path, help="the run's run.toml (an operator planning before launch)")
    plan.add_argument("--device", default="cuda", help="cpu or cuda (the plan's rules differ: CUDA graphs, KV slots)")
    plan.add_argument("--free-gib", type=float, required=True, help="memory the role would have on that device")
    plan.add_argument("--role", choices=("inference", "validator", "trainer", "all"), default="all")
    plan.add_argument("--dp", type=int, default=1, help="a trainer's data-parallel ranks (FSDP shards over them)")
    plan.set_defaults(func=run_plan)


def pinned_model(source: str, dtype: str | None = None, max_seq_len: int | None = None) -> ModelSpec:
    """The spec's model for checkpoint `source` with its weights hash and its FP8 mode as stored (ModelLoadError
    for a checkpoint that does not load, or tiny-moe, which is drawn from the recipe's seed)."""
    from node.model.errors import UnknownModelName
    from node.model.fill import checkpoint_digest
    from node.model.shards import CheckpointShards
    from node.model.spec import DTYPES, model_config, resolve

    spec = ModelSpec(source=source, dtype=dtype,
                     **({} if max_seq_len is None else {"max_seq_len": max_seq_len}))
    directory = resolve(spec.source)
    if directory is None:
        raise UnknownModelName(f"{source}: drawn from the run's recipe seed on every member; nothing to pin")
    shards = CheckpointShards(directory)
    weights_hash = checkpoint_digest(shards, model_config(spec), DTYPES[spec.dtype])
    return spec.model_copy(update={"weights_hash": weights_hash, "fp8": shards.fp8_mode()})


def run_pin(args: argparse.Namespace) -> int:
    from node.run_config import to_toml

    t0 = time.perf_counter()
    spec = pinned_model(args.source, args.dtype, args.max_seq_len)
    log.info("%s hashed in %.1f s", args.source, time.perf_counter() - t0)
    table = {k: v for k, v in spec.model_dump().items() if not (k == "fp8" and v == "off")}
    print(to_toml({"model": table}), end="")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from node.engine.memory_plan import MemoryPlanDoesNotFit
    from node.launch_guard import LaunchError
    from node.roles.memory import role_plan
    from protocol.messages import RunSpec

    if args.spec is not None:
        try:
            spec = RunSpec.model_validate_json(args.spec.read_bytes())
        except (OSError, ValueError) as exc:
            raise LaunchError(f"--spec {args.spec}: {str(exc).splitlines()[0]}") from None
    else:
        from node.run_config import RunConfig

        spec = RunConfig.load(args.config).run_spec("12D3KooW" + "1" * 44)  # a placeholder coordinator: plans ignore it
    roles = ("inference", "validator", "trainer") if args.role == "all" else (args.role,)
    refused = []
    for role in roles:
        engine = "builtin-cuda" if role == "inference" and args.device.startswith("cuda") else "builtin"
        plan = role_plan(spec, role, args.device, int(args.free_gib * 2**30), engine=engine,
                         parallel={"dp": args.dp} if role == "trainer" else None)
        if plan is None:
            continue
        print(plan.describe(), flush=True)
        try:
            plan.check()
        except MemoryPlanDoesNotFit as exc:
            refused.append(str(exc))
    if refused:
        raise MemoryPlanDoesNotFit("; ".join(refused))
    return 0

