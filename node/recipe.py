"""A run's learning recipe: model shape, optimiser, sampling, steps; the one home of their defaults.

The coordinator's operator writes it as `run.toml`'s `[recipe]` table (`node.run_config`); the
coordinator signs it into the run spec (`RunSpec.recipe`, the keys the operator set, as plain
values: a spec's bytes and hash do not change when a default here does not apply); every role reads
it back with `Recipe.of(spec)`. Unknown keys and values out of bounds are refused on both ends: at
`coordinator launch` (a misspelt `lrr = 1e-3` is an error there, not a silent default), and by a
node whose recipe does not know a key the coordinator's does (an older node).

Defaults are the train-local recipe (node/train_local.py) that reaches ~0.88 reward on reverse in
~500 steps.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from node.model.tiny import TinyMoE
from protocol.messages import RunSpec
from protocol.model_spec import TINY_MOE

_TINY = TinyMoE.model_fields
"""The tiny MoE's shape fields: default, bounds and docstring live on `TinyMoE` (node/model/tiny.py)."""


class InvalidRecipe(ValueError):
    """A recipe with an unknown key or a value out of bounds."""


class Recipe(BaseModel):
    """What the trainer and inference nodes follow (unknown keys are refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    hidden: int = _TINY["hidden"]
    layers: int = _TINY["layers"]
    experts: int = _TINY["experts"]
    top_k: int = _TINY["top_k"]
    lr: float = Field(1e-3, gt=0, le=1.0)
    """AdamW learning rate (cosine-decayed over `steps`)."""
    steps: int = Field(500, ge=1, le=10_000_000)
    """Trainer steps (= the last policy version the run publishes)."""
    temperature: float = Field(1.0, gt=0, le=10.0)
    """Sampling temperature of inference nodes; the trainer and validators use it too."""
    warmup_target: float = Field(0.25, ge=0, le=1)
    """Greedy reward the trainer's supervised warm-up reaches before version 0 (tiny-moe only: a run of a
    checkpoint starts from its weights, its default is 0 and a value above 0 is refused, `for_model`)."""
    seed: int = _TINY["seed"]  # the model's initialisation seed; the warm-up's tasks derive from it too
    updates_per_batch: int = Field(2, ge=1, le=64)
    """Passes over each batch (each a trust-region-masked update)."""
    minibatches: int = Field(2, ge=1, le=4096)
    """Optimizer steps per pass."""
    tool_wait_s: float = Field(0.0, ge=0, le=3600)
    """Median of a heavy-tailed simulated tool-call wait per episode (0: none; benchmarks.async_speedup)."""
    super_seed_copies: int = Field(0, ge=0, le=64)
    """The trainer's shardcast origin hands each shard of a version out this many times, then hides
    it, so relays spread it and the trainer's uplink sends ~1 copy (`shardcast.seeding`; 0: off).
    Needs relays among the spec's `shardcast_sources` (they then mirror from each other too); with
    none, the trainer logs it and serves every request."""
    router_replay: bool = True
    """Inference nodes send the experts their engine routed each position to, validators check them,
    and the trainer replays them (MoE models only; 1/0, true/false)."""
    train_fp8: bool = False
    """The trainer's decoder projections and expert banks compute in block-scaled FP8, forward and
    backward (node/rl/fp8.py: master weights and AdamW states stay in the parameters' dtype); the
    trainer then matches an FP8-serving engine ~9x closer (mismatch KL, docs/fp8.md). One-process
    trainer only (1/0, true/false)."""

    @field_validator("router_replay", "train_fp8", mode="before")
    @classmethod
    def _flag(cls, value: object) -> object:
        if isinstance(value, str):  # "1", "true", "yes", "on" (as the dict recipe read them)
            return value.strip().lower() in ("1", "true", "yes", "on")
        return value

    def tiny_shape(self) -> TinyMoE:
        """The tiny MoE this recipe shapes and seeds (used when the run's model is tiny-moe)."""
        return TinyMoE(**{k: getattr(self, k) for k in TinyMoE.model_fields})

    @classmethod
    def parse(cls, values: dict) -> "Recipe":
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise InvalidRecipe("; ".join(f"recipe.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                                          for e in exc.errors(include_url=False))) from None

    @classmethod
    def of(cls, spec: RunSpec) -> "Recipe":
        """The run spec's recipe (defaults for what it does not set, the model's among them)."""
        return cls.parse(spec.recipe).for_model(spec.model.source)

    def for_model(self, source: str) -> "Recipe":
        """This recipe as a run of `source` follows it. The supervised warm-up teaches tiny-moe's random
        initialisation on the CPU engine in seconds; a checkpoint (pretrained, or random weights written as
        one) starts from its own weights: its warm-up is 0, and a `warmup_target` set above 0 is refused
        (InvalidRecipe), where it would copy the whole model to the CPU and train it there in one process."""
        if source == TINY_MOE:
            return self
        if "warmup_target" in self.model_fields_set and self.warmup_target > 0:
            raise InvalidRecipe(f"recipe.warmup_target = {self.warmup_target}: the supervised warm-up is for "
                                f"{TINY_MOE}'s random initialisation; model {source!r} is a checkpoint and starts "
                                "from its own weights (drop the key or set it to 0)")
        return self.model_copy(update={"warmup_target": 0.0})

    def wire(self) -> dict[str, float | int | str]:
        """The keys set explicitly, as the run spec carries them (flags as 1/0)."""
        return {k: int(v) if isinstance(v, bool) else v for k, v in self.model_dump(exclude_unset=True).items()}


DEFAULT = Recipe()
"""The recipe of a run whose spec sets nothing."""
