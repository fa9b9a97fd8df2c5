"""`run.toml`: what a coordinator operator writes to launch a run; validated here, signed as a `RunSpec`.

Example:
    run_id = "reverse-1"
    task = "reverse"
    batch_groups = 64          # prompts per trainer step
    group_size = 8             # samples per prompt
    max_off_policy_steps = 1
    verification_rate = 1.0
    heartbeat_interval_s = 2.0
    shardcast_sources = ["http://127.0.0.1:8470", "http://127.0.0.1:8471"]
    trainer = "12D3Koo..."     # the trainer's node id (primerl-node keygen)
    validators = ["12D3Koo..."]
    listen = "/ip4/127.0.0.1/tcp/4001"
    status_port = 8480
    engines = ["builtin"]      # add "vllm" to accept `join --engine vllm` nodes
    [model]
    fp8 = "experts"            # serve block-scaled FP8 experts ("all": every projection; default "off"); docs/fp8.md
    [recipe]
    steps = 500
    lr = 1e-3
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from node.envs import DEFAULT_TASK, get_env
from node.model.errors import ModelLoadError
from node.recipe import Recipe
from protocol.messages import RunSpec
from protocol.model_spec import ModelSpec

_SPEC = RunSpec.model_fields
"""Run-shape defaults live on the run spec; a run.toml that omits a key gets the spec's default."""


class InvalidRunConfig(ValueError):
    """A run.toml with an unknown key, a value out of bounds, or an unknown task."""


class RunConfig(BaseModel):
    """A run as its operator describes it (unknown keys are refused)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    run_id: str = Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")
    """Names the run."""
    task: str = DEFAULT_TASK
    """Environment: built-in reverse | addition | calculator | coding | reverse-text | arithmetic, a native
    `Environment` from your own module as `<python.module>:<attr>` (pinned in the spec by its source hash:
    node/envs/user.py), or a `verifiers` one as `verifiers:<id>` / `verifiers:<python.module>:<attr>`
    (contrib/verifiers; `pip install -e '.[verifiers]'`)."""
    model: ModelSpec = Field(default_factory=ModelSpec)
    """The run's model (protocol/model_spec.py): a name (`model = "smollm2-135m-instruct"`) or a
    `[model]` table with source, dtype, weights_hash, max_seq_len, fp8 (off | experts | all: the serving precision
    inference nodes follow and validators recompute in); tiny-moe's shape comes from `recipe`."""

    @field_validator("model", mode="before")
    @classmethod
    def _model_name(cls, value: object) -> object:
        return {"source": value} if isinstance(value, str) else value
    batch_groups: int = Field(64, ge=1)
    """Prompts (work units) per trainer step."""
    group_size: int = Field(8, ge=1, le=256)
    """Samples per prompt."""
    max_off_policy_steps: int = Field(_SPEC["max_off_policy_steps"].default, ge=0, le=1024)
    """k: rollouts at most k versions behind enter a batch (0: synchronous)."""
    verification_rate: float = Field(_SPEC["verification_rate"].default, ge=0, le=1)
    """Share of work units verified before batching."""
    heartbeat_interval_s: float = Field(_SPEC["heartbeat_interval_s"].default, gt=0)
    """Member heartbeat period."""
    dead_after_missed: int = Field(_SPEC["dead_after_missed"].default, ge=1)
    """Missed beats until a member is dead and its leases go back to the pool."""
    lease_ttl_s: float = Field(_SPEC["lease_ttl_s"].default, gt=0)
    """Lease lifetime."""
    shardcast_sources: list[str] = Field(default_factory=list)
    """Where policy versions are served (trainer origin first, then relays)."""
    trainer: str | None = None
    """Node id of the only trainer, the one key whose weights every member accepts. Required: a run
    without one is refused at launch (any member could otherwise publish weights)."""
    validators: list[str] = Field(default_factory=list)
    """Node ids of the validators: the only members that may pull work to verify and send verdicts.
    Required (at least one) when verification_rate > 0."""
    listen: str = "/ip4/127.0.0.1/tcp/4001"
    """Coordinator's libp2p listen multiaddr."""
    status_port: int = Field(8480, ge=0, le=65535)
    """HTTP port of the status page and /metrics (0: any free port)."""
    recipe: Recipe = Field(default_factory=Recipe)
    """Learning recipe (node/recipe.py: every key, its bounds and its default); unknown keys are refused."""
    engines: list[Literal["builtin", "vllm"]] = Field(default_factory=lambda: ["builtin"], min_length=1)
    """Inference engines whose rollouts the run accepts; add "vllm" to accept rollouts whose sampling
    a validator cannot re-derive (checked on proofs, logprobs, termination, reward; RunSpec.engines)."""

    @model_validator(mode="after")
    def _who_may_train_and_judge(self) -> "RunConfig":
        if not self.trainer:
            raise ValueError("`trainer` is required: the node id of the trainer (`primerl-node keygen`); "
                             "members accept weights signed by that key only")
        self.recipe.for_model(self.model.source)  # a warm-up asked of a checkpoint is refused here, at launch
        if self.verification_rate > 0 and not self.validators:
            raise ValueError(f"verification_rate = {self.verification_rate} needs `validators` (their node ids): "
                             "only the validators the spec names may judge work; or set verification_rate = 0")
        return self

    @classmethod
    def load(cls, path: str | Path) -> "RunConfig":
        try:
            cfg = cls.model_validate(tomllib.loads(Path(path).read_text()))
            get_env(cfg.task)  # an unknown task fails at launch, not in every node
        except ValidationError as exc:
            raise InvalidRunConfig(f"{path}: " + "; ".join(_say(e) for e in exc.errors(include_url=False))) from None
        except tomllib.TOMLDecodeError as exc:
            raise InvalidRunConfig(f"{path}: {exc}") from None
        return cfg

    def _model_as_stored(self) -> ModelSpec:
        """The `[model]` table, its `fp8` taken from the checkpoint when the table does not name it: a
        block-scaled FP8 checkpoint (here, where the run is launched) is served as it is stored."""
        if "fp8" in self.model.model_fields_set:
            return self.model
        from node.model.spec import resolve
        from node.model.hf_config import read_quantization
        from node.model.shards import CheckpointShards

        try:
            directory = resolve(self.model.source)
        except ModelLoadError:
            return self.model  # not on this machine: the members check it
        if directory is None or not (directory / "config.json").exists() or read_quantization(directory) is None:
            return self.model  # plain floating point: nothing to read from the shards
        shards = CheckpointShards(directory)
        return self.model if shards.quantization is None else self.model.model_copy(update={"fp8": shards.fp8_mode()})

    def run_spec(self, coordinator_peer_id: str) -> RunSpec:
        from node.envs.user import is_user_task, task_identity

        # a user task travels pinned to its source: every node checks it runs the same code
        environment = task_identity(self.task) if is_user_task(self.task) else self.task
        return RunSpec(run_id=self.run_id, coordinator=coordinator_peer_id, model=self._model_as_stored(),
                       environment=environment,
                       max_off_policy_steps=self.max_off_policy_steps, heartbeat_interval_s=self.heartbeat_interval_s,
                       dead_after_missed=self.dead_after_missed, lease_ttl_s=self.lease_ttl_s,
                       group_size=self.group_size, batch_groups=self.batch_groups,
                       verification_rate=self.verification_rate, shardcast_sources=self.shardcast_sources,
                       trainer=self.trainer, validators=self.validators, recipe=self.recipe.wire(),
                       engines=tuple(self.engines))


def _say(error: dict) -> str:
    """One pydantic error as an operator reads it: `key: what is wrong` (a check across keys has no key)."""
    msg = error["msg"].removeprefix("Value error, ")
    where = ".".join(str(p) for p in error["loc"])
    if error["type"] == "extra_forbidden":
        msg = "unknown key"
        loc = error["loc"]
        if len(loc) == 2 and loc[0] in ("recipe", "model") and loc[1] in RunConfig.model_fields:
            msg += f" in [{loc[0]}]; `{loc[1]}` is a top-level key: TOML puts every key after a [table] line in that table"
    return f"{where}: {msg}" if where else msg


def to_toml(values: dict) -> str:
    """Minimal TOML writer for run configs (flat keys, lists of strings, one [recipe] table)."""
    def lit(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(lit(x) for x in v) + "]"
        return repr(v)
    lines = [f"{k} = {lit(v)}" for k, v in values.items() if not isinstance(v, dict) and v is not None]
    for table, entries in values.items():  # [recipe], [model]
        if isinstance(entries, dict) and entries:
            lines.append(f"[{table}]")
            lines += [f"{k} = {lit(v)}" for k, v in entries.items() if v is not None]
    return "\n".join(lines) + "\n"
