"""What an inference node claims about one rollout, as the validator receives it (a trust boundary).

The claim carries everything needed to recompute the rollout: the task (environment + seed), the
prompt and completion tokens, per-token logprobs and versions, the sampling parameters of the work
lease, the finish reason, the reward, and the wire proof (`verification.proof`). `digest()` names
the claim in a verdict.
"""

from __future__ import annotations

import hashlib
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from protocol.messages import MAX_ROUTED_EXPERTS_BYTES, EngineName

MAX_TOKENS = 131_072
"""Longest prompt or completion accepted (matches protocol.messages.MAX_ROLLOUT_TOKENS)."""


class SamplingSpec(BaseModel):
    """The sampling parameters the work lease prescribed."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    temperature: float = Field(1.0, ge=0)
    """Softmax temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus mass."""
    max_new_tokens: int = Field(32, ge=1)
    """Length limit of one model turn."""
    seed: int = Field(0, ge=0)
    """Sampling seed (derived from the work id)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a turn besides EOS."""
    stop_strings: tuple[str, ...] = ()
    """Strings that end a turn."""


class RolloutClaim(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_bytes="base64", val_json_bytes="base64")
    work_id: int = Field(ge=0)
    """The leased work this rollout answers."""
    env: str = Field(min_length=1, max_length=64)
    """Environment name."""
    task_seed: int = Field(ge=0)
    """Seed the task was drawn from (derived by the coordinator)."""
    prompt_ids: list[int] = Field(min_length=1, max_length=MAX_TOKENS)
    """Prompt tokens."""
    token_ids: list[int] = Field(min_length=1, max_length=MAX_TOKENS)
    """Completion tokens (model turns and, multi-turn, tool replies)."""
    logprobs: list[float] = Field(max_length=MAX_TOKENS)
    """Sampling logprob of each completion token (0 on tool tokens)."""
    versions: list[int] = Field(max_length=MAX_TOKENS)
    """Policy version behind each completion token."""
    sampled: list[bool] | None = None
    """True where the model sampled the token (None: all of them)."""
    sampling: SamplingSpec = SamplingSpec()
    """The lease's sampling parameters."""
    finish_reason: Literal["eos", "stop", "length"]
    """Why generation stopped."""
    reward: float
    """Environment reward claimed."""
    proof: bytes = Field(max_length=1 << 22)
    """Wire proof: `verification.proof.encode_rollout_proof`."""
    engine: EngineName = "builtin"
    """Engine that sampled the tokens (the submission says): only the built-in engine's seeded
    choices can be re-derived (`verification.checks.SEEDED_ENGINES`)."""
    routed_experts: bytes | None = Field(None, max_length=MAX_ROUTED_EXPERTS_BYTES)
    """Experts claimed for each of the prompt + completion - 1 positions, in the node's route wire form
    (the `Reference` decodes it; None: no routes claimed). Omitted from the digest when None, so
    claims without routes keep their digests."""

    @model_serializer(mode="wrap")
    def _omit_no_routes(self, handler):
        data = handler(self)
        if data.get("routed_experts", b"") is None:
            del data["routed_experts"]
        return data

    @model_validator(mode="after")
    def _lines_up(self) -> "RolloutClaim":
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n or (self.sampled is not None and len(self.sampled) != n):
            raise ValueError("logprobs, versions and sampled must have one entry per completion token")
        if not math.isfinite(self.reward) or not all(math.isfinite(x) for x in self.logprobs):
            raise ValueError("reward and logprobs must be finite")
        if min(self.prompt_ids + self.token_ids) < 0 or min(self.versions, default=0) < 0:
            raise ValueError("token ids and versions must be non-negative")
        return self

    @property
    def sampled_mask(self) -> list[bool]:
        return self.sampled if self.sampled is not None else [True] * len(self.token_ids)

    def digest(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()
