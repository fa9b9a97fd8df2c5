"""What `primerl-node sim` runs: `SimConfig` is `run_sim`'s, `SimFlags` the command line's (the same fields,
plus those only a person at the keyboard spells: the output directory, a device, a model name).

Run defaults come from run.toml's (node/run_config.py), recipe defaults from node/recipe.py; each is
written there once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from node.adversary import CHEATS
from node.config_flags import Flag
from node.envs import DEFAULT_TASK
from node.recipe import Recipe
from node.run_config import RunConfig
from node.sim_deadline import STALL_S, START_ALLOWANCE_S, STEP_ALLOWANCE_S, STOP_AFTER_TARGET
from node.sim_devices import Placement
from node.sim_report import REWARD_TARGET
from protocol.model_spec import FP8Mode

_RUN, _RECIPE = RunConfig.model_fields, Recipe.model_fields


class SimConfig(BaseModel):
    """One simulated network run."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, arbitrary_types_allowed=True)
    inference_nodes: int = Field(4, ge=1)
    """inference nodes (each its own process)"""
    steps: int = _RECIPE["steps"]
    task: str = DEFAULT_TASK
    """the run's task (run.toml `task`)"""
    churn: bool = False
    """SIGKILL/restart inference nodes, and the coordinator once"""
    cheaters: int = Field(0, ge=0)
    """inference nodes that tamper with their work"""
    cheat_kinds: Annotated[tuple[str, ...], Flag(cli=False)] = CHEATS
    """each cheater's kind, in turn (node/adversary.py: CHEATS, and JUNK's malformed units)"""
    vllm_nodes: int = Field(0, ge=0)
    """inference nodes on vLLM (join --engine vllm; needs PRIMERL_VLLM_PYTHON)"""
    max_off_policy_steps: int = _RUN["max_off_policy_steps"]
    seed: int = Field(0, ge=0)
    """the run's seed (run id, recipe seed, churn's choices)"""
    batch_groups: int = _RUN["batch_groups"]
    group_size: int = _RUN["group_size"]
    timeout_s: Annotated[float | None, Flag(name="--timeout"), Field(gt=0)] = None
    """a hard limit in seconds (None: the limit follows the work: start-up + a per-step allowance, raised to
    the measured pace, the run ending early only when no step finishes for a while; node/sim_deadline.py)"""
    stop_after_target: Annotated[int | None, Flag(metavar="N"), Field(ge=0)] = None
    """end the run this many steps after the reward target (None: train all `steps`)"""
    trainer_parallel: Annotated[str | None, Flag(metavar="LAYOUT")] = None
    """run the trainer as torchrun ranks (gloo on CPU), e.g. dp2-ep2, cp2, dp2-ep2-cp2"""
    engine: str = "builtin"
    """the honest built-in inference nodes' `--engine` (vLLM nodes excepted)"""
    fp8: FP8Mode = "off"
    """the run serves FP8 (spec model.fp8): every built-in inference node serves block-scaled e4m3 weights
    (builtin on the CPU, builtin-cuda with --device cuda) and the validator recomputes with the same
    quantisation and FP8 thresholds (docs/fp8.md)"""
    inference_ep: Annotated[int, Flag(name="--ep", metavar="N"), Field(ge=1)] = 1
    """each built-in inference node serves over N expert-parallel processes (join --ep N, engine builtin-ep,
    gloo on the CPU); N must divide the recipe's experts"""
    recipe: Annotated[dict | None, Flag(cli=False)] = None
    """run.toml `[recipe]` keys on top of steps and seed"""
    model: Annotated[dict | None, Flag(cli=False)] = None
    """the run's `[model]` table (protocol/model_spec.py; None: the recipe-shaped tiny MoE)"""
    run: Annotated[dict | None, Flag(cli=False)] = None
    """run.toml keys to override (e.g. a longer dead_after_missed for a large model on a busy machine)"""
    stop_when: Annotated[Callable[[int], bool] | None, Flag(cli=False)] = None
    """called with the steps done at each poll; True ends the run there, every role stopped as at a timeout
    (status "stopped": tests stop on progress, not after a fixed time)"""
    placement: Annotated[Placement | None, Flag(cli=False)] = None
    """each role's `--device` (node/sim_devices.py; None: all on the CPU)"""
    shared_store: bool = True
    """every role shares one shardcast store, OUT/shardcast (`join --store`), as the roles of one machine
    should: each version is held once on the host; False gives each role its own (WORKDIR/shardcast)"""
    store_max_gib: Annotated[float | None, Flag(metavar="GIB"), Field(gt=0)] = None
    """the store's byte budget (`join --store-max-gib`)"""
    store_dir: Annotated[Path | None, Flag(metavar="DIR")] = None
    """the shared store's directory (default OUT/shardcast; OUT/shardcast then links to it), e.g. on tmpfs where
    the host has the memory: versions are written once per host and dropped within a few steps"""
    store_payloads: Annotated[Path | None, Flag(metavar="DIR")] = None
    """where the shared store keeps decoded payloads (`join --store-payloads`), e.g. on tmpfs: the trainer's
    version files then never reach the disk the host's roles share (only their wire shards do)"""
    trainer_checkpoint_every: Annotated[int | None, Flag(metavar="N"), Field(ge=0)] = None
    """the trainer's `join --checkpoint-every` (None: its default; 0: no checkpoint, not even the last)"""
    trainer_master_float32: bool = False
    """the trainer's `join --master-float32`: float32 weights and AdamW states in a bf16 run, each version published
    in bf16"""
    mps: bool = False
    """the roles on GPUs reach them through NVIDIA's multi-process service (one daemon for the sim,
    node/sim_mps.py): their kernels share a GPU at once instead of taking turns in time slices"""
    coordinator_state: Annotated[Path | None, Flag(metavar="DIR")] = None
    """the coordinator's state directory (default OUT/coordinator; OUT/coordinator then links to it): on a host
    whose roles share one disk, a directory on another filesystem keeps the coordinator's fsyncs from waiting
    behind the trainer's version files, as a coordinator on a machine of its own would"""

    @model_validator(mode="after")
    def _store_dir_is_the_shared_stores(self) -> "SimConfig":
        if self.store_dir is not None and not self.shared_store:
            raise ValueError("store_dir places the host's shared store: it cannot go with shared_store off")
        if self.store_payloads is not None and not self.shared_store:
            raise ValueError("store_payloads places the host's shared store's payloads: it cannot go with "
                             "shared_store off")
        return self


class SimFlags(SimConfig):
    """`primerl-node sim`'s flags."""

    out: Path
    """the run's directory: every role's state and log, metrics.jsonl, summary.json, report.png"""
    timeout_s: Annotated[float | None, Flag(name="--timeout")] = Field(None, gt=0, description=(
        f"a hard limit in seconds (default: {START_ALLOWANCE_S:.0f} s + {STEP_ALLOWANCE_S:.0f} s per step, + vLLM's "
        f"start-up, raised to the measured pace; the run also ends when no step finishes for {STALL_S:.0f} s)"))
    stop_after_target: Annotated[int, Flag(metavar="N")] = Field(STOP_AFTER_TARGET, ge=-1, description=(
        f"end N steps after the 5-step mean reward reaches {REWARD_TARGET} (-1: train all --steps)"))
    engine: str | None = None
    """the inference nodes' engine (default: builtin on the CPU, builtin-cuda with --device cuda)"""
    device: Literal["cpu", "cuda"] = "cpu"
    """cuda: trainer on GPU 0, inference nodes on the other GPUs, validator on the last (node/sim_devices.py);
    coordinator and relay on the CPU"""
    model_name: Annotated[str | None, Flag(name="--model")] = None
    """the run's model: tiny-moe (default), smollm2-135m-instruct, or an HF-layout directory"""
