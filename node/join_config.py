"""What `coordinator launch` and `join` take on the command line: one field per flag, its docstring
the flag's `--help`, its default written here alone (`node.config_flags` makes the flags)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from node.config_flags import Flag
from protocol.coordinator import RETAIN_VERSIONS
from protocol.model_spec import FP8Mode
from shardcast import DEFAULT_PORT

Role = Literal["inference", "trainer", "validator", "relay"]
PARALLELISM = "parallelism (trainer: launch with torchrun, world = dp x cp; inference: --ep only)"


class LaunchConfig(BaseModel):
    """`primerl-node coordinator launch`."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    config: Path
    """run.toml (see node/run_config.py)"""
    state: Path = Path("coordinator-state")
    """state directory (SQLite + rollouts)"""
    key: Path | None = None
    """coordinator key (created if missing; default STATE/coordinator.key)"""
    addr_file: Path | None = None
    """write the bootstrap multiaddr and status URL here"""
    retain_versions: int = Field(RETAIN_VERSIONS, ge=1)
    """keep finished work (trained on or dropped) of this many newest policy versions; older work leaves the
    store (its totals and reward curve stay on the status page)"""


class JoinConfig(BaseModel):
    """`primerl-node join`: one role of a run on this machine."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    role: Role
    """the role this node plays in the run"""
    bootstrap: str
    """coordinator multiaddr (/ip4/…/tcp/…/p2p/<id>)"""
    spec: Path | None = None
    """the run's spec.json (default: ask the bootstrap coordinator for it)"""
    key: Path | None = None
    """node key file (created if missing; default WORKDIR/node.key)"""
    workdir: Path = Path("node-state")
    """shards, checkpoints, metrics"""
    store: Path | None = None
    """the shardcast store (default WORKDIR/shardcast): roles of one machine given the same directory hold each
    policy version once (a second role fetching it waits for the first and reads its copy)"""
    store_max_gib: float | None = Field(None, gt=0)
    """byte budget of the run's files in the store: beyond it, decoded payloads other than the newest go first,
    then the oldest versions (never the newest nor the delta chain it needs)"""
    store_payloads: Path | None = None
    """where the store keeps decoded payloads (each as large as the model; the wire shards on disk rebuild them),
    e.g. on tmpfs (/dev/shm/...) where the host has the memory, so a version is not written to the disk that the
    host's roles share; recorded in the store, so the host's other roles find them without the flag"""
    shardcast_port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    """trainer/relay: HTTP port serving shards"""
    host: str = "127.0.0.1"
    """trainer/relay: address the shard server and libp2p listen on (0.0.0.0 to serve other machines; the run
    spec's shardcast_sources must name a reachable URL)"""
    engine: str | None = None
    """inference engine (default: builtin, or builtin-ep with --ep N > 1; node/engine/registry.py)"""
    trace_versions: bool = False
    """inference: append when each policy version was announced, fetched and queued to WORKDIR/versions.jsonl
    (validator: when each was held, after how long, from what); inference and validator: each round's times and
    tokens to WORKDIR/rounds.jsonl (node/version_trace.py; benchmarks weight_latency and gpu_network)"""
    vllm: Annotated[list[str], Flag(metavar="KEY=VALUE")] = []
    """with --engine vllm: a vLLM setting (contrib/vllm/settings.py VLLMSettings field), repeatable, e.g.
    --vllm data_parallel=8 --vllm quantization=fp8"""
    device: str | None = None
    """where this role runs the run's model: cpu | cuda | cuda:I (default: cuda for --engine builtin-cuda,
    else cpu)"""
    fp8: FP8Mode | None = None
    """block-scaled FP8 weights for the routed experts only, or for every projection (builtin-cuda on an
    H100/H200-class GPU; builtin on the CPU, slowly). Default: what the run spec's model.fp8 says; a value
    that differs from it is refused (validators recompute that way; docs/fp8.md)"""
    gpu_memory_share: float = Field(0.9, gt=0, le=1)
    """inference on a GPU: share of the memory free after the weights that the engine's KV slots may take;
    the slots (sequences decoded at once) are sized from it and the plan printed at start (lower it where
    other roles share the GPU; node/engine/memory_plan.py)"""
    memory_limit_gib: float | None = Field(None, gt=0)
    """the most memory this role may plan for on its device, in GiB (default: what the device has free: host
    RAM on the CPU, free GPU memory on a GPU); the plan is printed at start, and one that does not fit
    exits 2 before anything is allocated (node/roles/memory.py)"""
    dp: Annotated[int, Flag(group=PARALLELISM), Field(ge=1)] = 1
    """data-parallel ranks (FSDP2)"""
    ep: Annotated[int, Flag(group=PARALLELISM), Field(ge=1)] = 1
    """trainer: expert-parallel ranks, taken from dp; inference: N processes of this host (engine
    builtin-ep; one GPU each with --device cuda), started by this command unless under torchrun
    --nproc-per-node N"""
    cp: Annotated[int, Flag(group=PARALLELISM), Field(ge=1)] = 1
    """context-parallel ranks"""
    fsdp: Annotated[bool, Flag(group=PARALLELISM)] = True
    """replicate instead of sharding"""
    checkpoint_every: Annotated[int | None, Flag(metavar="N"), Field(ge=0)] = None
    """trainer: steps between its checkpoints (the resume point after a crash; the last step is always saved;
    default node/roles/trainer.py CHECKPOINT_EVERY, 20); 0: none at all, not even the last (a benchmark's run,
    whose minute of writing a 5.2B checkpoint is no step)"""
    master_float32: bool = False
    """trainer, one process: keep the weights and AdamW's states in float32 for a bfloat16 or float16 run, and
    publish each version in the run's dtype: an update below half a bf16 step adds up instead of being lost in
    the rounding (twice the weights' memory, and a float32 step; a trainer world keeps a float32 master anyway)"""
    activation_checkpointing: Annotated[bool, Flag(group=PARALLELISM)] = False
    """recompute each decoder layer's activations in the backward (long contexts, large batches)"""

    def parallel(self) -> dict:
        """The trainer's layout as `TrainerNode(parallel=...)` takes it."""
        return {"dp": self.dp, "ep": self.ep, "cp": self.cp, "fsdp": self.fsdp,
                "activation_checkpointing": self.activation_checkpointing}
