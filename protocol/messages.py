"""Every message a node sends, as versioned pydantic models, and their one wire form (JSON bytes).

Invariant: `decode_message(encode_message(m)) == m` for every message, and `decode_message` on any
other bytes raises `MalformedMessage` or `MessageTooLarge`, never anything else. Each model carries
`type` (the discriminator) and `v` (schema version); unknown fields are refused, so a peer that
speaks another version is told so instead of being half-understood. Messages travel inside a signed
envelope (`protocol.envelope`), which adds signer, run id, timestamp and nonce.
"""

from __future__ import annotations

import hashlib
import math
from typing import Annotated, ClassVar, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_serializer,
                      model_validator)

from protocol.model_spec import ModelSpec
from protocol.errors import MalformedMessage, MessageTooLarge

Role = Literal["coordinator", "inference", "trainer", "validator", "relay"]
PeerIdStr = Annotated[str, Field(min_length=1, max_length=128)]
Multiaddr = Annotated[str, Field(min_length=1, max_length=256)]
Hex32 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Reason = Annotated[str, Field(max_length=512)]
EngineName = Literal["builtin", "vllm"]
"""Inference engine that sampled a rollout. "builtin" draws with the run's seeded rule (seeds from
work id and position), so a validator re-derives every choice; "vllm" draws from vLLM's own
generator, so its choices are bound by logprobs and proofs but cannot be re-derived."""
BUILTIN_ONLY: tuple[EngineName, ...] = ("builtin",)

MAX_INT64 = (1 << 63) - 1
"""Bound of every integer field: the largest integer SQLite stores. Without it, a work id of 10^30
reached the coordinator's store and raised OverflowError there (found by benchmarks.fuzz;
tests/fuzz/test_regressions.py)."""
MAX_ROLLOUT_TOKENS = 131_072
"""Longest completion a submission may carry (128 Ki tokens: long-context RL, still < 4 MiB JSON)."""
MAX_PROOF_BYTES = 1 << 20
"""258 bytes per 32-token chunk (TOPLOC-style) x 4096 chunks = ~1 MiB covers MAX_ROLLOUT_TOKENS."""
MAX_ROUTED_EXPERTS_BYTES = 4 << 20
"""Routes of one rollout (node/model/routing.py: one byte per expert id up to 256 experts). 4 MiB
travels as ~5.3 MiB of base64, inside a submission's 8 MiB with its tokens and proof; at the
Qwen3-30B-A3B shape (48 MoE layers x top-8 = 384 bytes per position) that is ~10,900 positions."""


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_bytes="base64", val_json_bytes="base64")
    max_body_bytes: ClassVar[int] = 64 * 1024
    """Largest encoded body of this type; checked on decode before the message is used."""
    v: Literal[1] = 1
    """Schema version of this message type."""


class RunSpec(Message):
    """What a global run is; signed by the coordinator; a joiner must name its hash."""

    type: Literal["run_spec"] = "run_spec"
    run_id: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
    """Names the run; every envelope is bound to it; gossip topics derive from it."""
    coordinator: PeerIdStr
    """PeerID of the coordinator, the only signer of leases and receipts."""
    model: ModelSpec = ModelSpec()
    """Model the run trains: weights' source, dtype, version 0's hash (protocol/model_spec.py).
    Omitted on the wire when default (the tiny MoE), so specs that do not name one keep their bytes."""
    environment: Annotated[str, Field(max_length=256)] = ""
    """Environment (task family) rollouts come from."""
    max_off_policy_steps: int = Field(1, ge=0, le=1024)
    """k: a rollout with any token older than (current version - k) never enters a batch."""
    heartbeat_interval_s: float = Field(10.0, gt=0, le=3600)
    """How often members announce themselves."""
    dead_after_missed: int = Field(3, ge=1, le=100)
    """Missed heartbeats after which a member is dead and its leases go back to the pool."""
    lease_ttl_s: float = Field(120.0, gt=0, le=86_400)
    """How long a work lease lasts before it is re-granted to someone else."""
    tasks_per_step: int = Field(1 << 20, ge=1, le=MAX_INT64)
    """Size of the task pool work ids draw from (task index = derived seed mod this)."""
    group_size: int = Field(1, ge=1, le=256)
    """Samples per work unit: one lease is one task answered by this many rollouts (a GRPO group).
    The wire default (1, as specs of the first schema, which lack the field, meant) is not run.toml's:
    `node.run_config.RunConfig` writes its own into every spec (docs/architecture.md)."""
    batch_groups: int = Field(1, ge=1, le=65_536)
    """Work units (groups) per trainer step (wire default as `group_size`'s)."""
    verification_rate: float = Field(1.0, ge=0.0, le=1.0)
    """Share of work units a validator must judge before they may enter a batch (1.0 in tests)."""
    shardcast_sources: list[Annotated[str, Field(max_length=256)]] = Field(default_factory=list, max_length=64)
    """HTTP base URLs serving the run's policy versions (trainer origin first, then relays)."""
    trainer: PeerIdStr | None = None
    """The only peer allowed to publish policy versions and take batches (None: any trainer member;
    `coordinator launch` refuses a run.toml without one)."""
    validators: list[PeerIdStr] = Field(default_factory=list, max_length=256)
    """The only peers (besides the coordinator's own key) that may pull work to verify and send
    verdicts. Empty: nobody else (`coordinator launch` refuses that with verification_rate > 0)."""
    recipe: dict[Annotated[str, Field(max_length=64)], float | int | str] = Field(default_factory=dict, max_length=64)
    """Learning recipe the trainer and inference nodes follow (model shape, lr, steps, temperature...)."""
    engines: tuple[EngineName, ...] = Field(BUILTIN_ONLY, min_length=1, max_length=8)
    """Engines whose rollouts the run accepts. Default: only the built-in one, whose every sampling
    choice a validator re-derives; a run that adds "vllm" accepts rollouts whose choices are checked
    through logprobs and proofs only (added in schema v1; omitted on the wire when default, so specs
    that do not name it keep their bytes and hash)."""

    @field_validator("model", mode="before")
    @classmethod
    def _model_name(cls, value: object) -> object:
        """A bare name (specs of schema v0 carried `model` as a string; "" meant the tiny MoE)."""
        if isinstance(value, str):
            return ModelSpec(source=value) if value else ModelSpec()
        return value

    @model_serializer(mode="wrap")
    def _omit_default_engines(self, handler):
        data = handler(self)
        if tuple(data.get("engines", ())) == BUILTIN_ONLY:
            del data["engines"]
        if data.get("model") == ModelSpec().model_dump():
            del data["model"]
        return data

    def spec_hash(self) -> str:
        return hashlib.sha256(encode_message(self)).hexdigest()


class PeerAddress(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    peer_id: PeerIdStr
    """The member's PeerID."""
    addrs: list[Multiaddr] = Field(default_factory=list, max_length=16)
    """Where it listens (multiaddrs without the /p2p suffix)."""


class Join(Message):
    type: Literal["join"] = "join"
    spec_hash: Hex32
    """Hash of the run spec the joiner agrees to."""
    role: Role
    """What the joiner will do."""
    addrs: list[Multiaddr] = Field(default_factory=list, max_length=16)
    """Where the joiner listens, so other members can dial it."""


class JoinAccepted(Message):
    type: Literal["join_accepted"] = "join_accepted"
    max_body_bytes: ClassVar[int] = 1 << 20
    spec: RunSpec
    """The run spec (its hash equals what the joiner named)."""
    policy_version: int = Field(ge=-1, le=MAX_INT64)
    """Latest published policy version (-1: none yet)."""
    members: list[PeerAddress] = Field(default_factory=list, max_length=4096)
    """Live members and where they listen: peers are found through the coordinator, then gossip."""


class Heartbeat(Message):
    type: Literal["heartbeat"] = "heartbeat"
    seq: int = Field(ge=0, le=MAX_INT64)
    """Counts up per sender; lets a reader drop reordered beats."""
    role: Role
    """The sender's role."""
    addrs: list[Multiaddr] = Field(default_factory=list, max_length=16)
    """Where the sender listens (gossip spreads addresses: peer discovery)."""


class Leave(Message):
    type: Literal["leave"] = "leave"
    reason: Reason = ""
    """Why the member leaves (free text, for logs)."""


class RunEnd(Message):
    """Trainer -> coordinator (request) when its last step is done; coordinator -> everyone (gossip):
    the run is over, every member leaves and exits 0."""

    type: Literal["run_end"] = "run_end"
    step: int = Field(ge=0, le=MAX_INT64)
    """The trainer's last step."""


class PolicyAnnounce(Message):
    type: Literal["policy_announce"] = "policy_announce"
    version: int = Field(ge=0, le=MAX_INT64)
    """The new policy version (= the trainer step that produced it)."""
    manifest_hash: Hex32
    """sha256 of the shardcast manifest for this version."""


class LeaseGrant(Message):
    type: Literal["lease_grant"] = "lease_grant"
    work_id: int = Field(ge=0, le=MAX_INT64)
    """Unique per run; results are accepted exactly once per work id."""
    holder: PeerIdStr
    """Who may submit the result."""
    policy_version: int = Field(ge=-1, le=MAX_INT64)
    """Coordinator's version when the work was first minted."""
    task_index: int = Field(ge=0, le=MAX_INT64)
    """Which task of the environment (derived, not chosen)."""
    seed: int = Field(ge=0, lt=1 << 64)
    """Sampling seed root (derived from run, step, work id)."""
    deadline: float = Field(gt=0)
    """Unix time after which the lease is re-granted and a submission refused."""


class RolloutSubmission(Message):
    type: Literal["rollout_submission"] = "rollout_submission"
    max_body_bytes: ClassVar[int] = 8 << 20
    work_id: int = Field(ge=0, le=MAX_INT64)
    """The leased work this rollout answers."""
    version_runs: list[tuple[Annotated[int, Field(ge=0, le=MAX_INT64)], Annotated[int, Field(ge=1, le=MAX_INT64)]]] = Field(min_length=1, max_length=4096)
    """Runs of (policy version, token count) covering the completion tokens in order."""
    token_ids: list[Annotated[int, Field(ge=0, lt=1 << 31)]] = Field(min_length=1, max_length=MAX_ROLLOUT_TOKENS)
    """Completion token ids."""
    logprobs: list[float] = Field(max_length=MAX_ROLLOUT_TOKENS)
    """Sampling log-probability of each completion token."""
    reward: float
    """Environment reward (finite)."""
    proof: bytes = Field(b"", max_length=MAX_PROOF_BYTES)
    """Verification proof (opaque here; see verification/)."""
    finish_reason: Literal["eos", "stop", "length"]
    """Why generation stopped."""
    sampled: list[bool] | None = None
    """True where the model sampled the token, False on tool replies (None: all sampled)."""
    engine: EngineName = "builtin"
    """Engine that sampled the tokens; must be one the run spec's `engines` names (added in schema
    v1; omitted on the wire when "builtin", so such submissions keep their bytes and signatures)."""
    routed_experts: bytes | None = Field(None, max_length=MAX_ROUTED_EXPERTS_BYTES)
    """Experts the engine routed each of the prompt + completion - 1 positions to, for router replay
    (`node.model.routing` wire form; None: not captured). Added in schema v1; omitted on the wire
    when None, so submissions without it keep their bytes and signatures."""

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler):
        data = handler(self)
        if data.get("engine") == "builtin":
            del data["engine"]
        if data.get("routed_experts", b"") is None:
            del data["routed_experts"]
        return data

    @model_validator(mode="after")
    def _lines_up(self) -> "RolloutSubmission":
        n = len(self.token_ids)
        if self.sampled is not None and len(self.sampled) != n:
            raise ValueError("one sampled flag per token")
        if len(self.logprobs) != n:
            raise ValueError(f"{len(self.logprobs)} logprobs for {n} tokens")
        if sum(length for _, length in self.version_runs) != n:
            raise ValueError("version runs do not cover the tokens exactly")
        if not math.isfinite(self.reward) or not all(math.isfinite(x) and x <= 0.0 for x in self.logprobs):
            raise ValueError("reward must be finite and logprobs finite and <= 0")
        return self

    @property
    def min_version(self) -> int:
        return min(version for version, _ in self.version_runs)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def token_versions(self) -> list[int]:
        """The policy version behind each completion token (the runs, expanded)."""
        return [version for version, length in self.version_runs for _ in range(length)]

    @staticmethod
    def runs_of(versions: list[int]) -> list[tuple[int, int]]:
        """Per-token versions as runs of (version, token count): the wire form of `version_runs`."""
        runs: list[tuple[int, int]] = []
        for v in versions:
            if runs and runs[-1][0] == v:
                runs[-1] = (v, runs[-1][1] + 1)
            else:
                runs.append((v, 1))
        return runs


class RolloutGroup(Message):
    """The answer to one work unit: `group_size` rollouts of the same task (one GRPO group)."""

    type: Literal["rollout_group"] = "rollout_group"
    max_body_bytes: ClassVar[int] = 8 << 20
    work_id: int = Field(ge=0, le=MAX_INT64)
    """The leased work this group answers (every rollout names it too)."""
    rollouts: list[RolloutSubmission] = Field(min_length=1, max_length=256)
    """The samples, in sample order (sample j used sampling seed `sampling_seed(seed, j)`)."""

    @model_validator(mode="after")
    def _one_work(self) -> "RolloutGroup":
        if any(r.work_id != self.work_id for r in self.rollouts):
            raise ValueError("every rollout of a group answers the group's work id")
        return self

    @property
    def min_version(self) -> int:
        return min(r.min_version for r in self.rollouts)

    @property
    def n_tokens(self) -> int:
        return sum(r.n_tokens for r in self.rollouts)

    @property
    def reward(self) -> float:
        return sum(r.reward for r in self.rollouts) / len(self.rollouts)


class LeaseBatchRequest(Message):
    """Inference: up to `count` work units (the one lease request; `LeaseGrants` answers it)."""

    type: Literal["lease_batch_request"] = "lease_batch_request"
    policy_version: int = Field(ge=-1, le=MAX_INT64)
    """Newest policy version the requester holds."""
    count: int = Field(ge=1, le=1024)
    """Most work units wanted; the coordinator may grant fewer (none while enough work is out)."""


class LeaseGrants(Message):
    type: Literal["lease_grants"] = "lease_grants"
    max_body_bytes: ClassVar[int] = 1 << 20
    grants: list[LeaseGrant] = Field(max_length=1024)
    """The granted work units (possibly none: ask again later)."""


class StoredWork(BaseModel):
    """An accepted work unit as the coordinator stored it: the submitter's signed envelope, as is."""

    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_bytes="base64", val_json_bytes="base64")
    work_id: int = Field(ge=0, le=MAX_INT64)
    """The work unit."""
    task_index: int = Field(ge=0, le=MAX_INT64)
    """Its derived task."""
    seed: int = Field(ge=0, lt=1 << 64)
    """Its derived sampling seed root."""
    envelope: bytes = Field(max_length=8 << 20)
    """The submitter's signed `RolloutGroup` (or `RolloutSubmission`) envelope."""


class BatchRequest(Message):
    """Trainer: the work units of trainer step `step` (idempotent: the same step gets the same units)."""

    type: Literal["batch_request"] = "batch_request"
    step: int = Field(ge=1, le=MAX_INT64)
    """The trainer step the batch is for (it produces policy version `step`)."""
    groups: int = Field(ge=1, le=65_536)
    """Work units wanted."""


class UnitFailure(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    work_id: int = Field(ge=0, le=MAX_INT64)
    """A unit of the batch the trainer cannot train on."""
    reason: Reason
    """What is wrong with it (type, shape, versions, tokens)."""


class BatchRejects(Message):
    """Trainer -> coordinator: units of step `step`'s batch that failed the trainer's checks. They are
    taken out of the batch for good and dropped, each a strike against its submitter; asking for the
    batch again tops it up with other units (`Ok` answers)."""

    type: Literal["batch_rejects"] = "batch_rejects"
    step: int = Field(ge=1, le=MAX_INT64)
    """The trainer step whose batch held them."""
    failures: list[UnitFailure] = Field(min_length=1, max_length=1024)
    """The units and why."""


class VerifyRequest(Message):
    """Validator: accepted work units that still need a verdict."""

    type: Literal["verify_request"] = "verify_request"
    max_items: int = Field(ge=1, le=4096)
    """Most work units to hand out."""


class StoredWorkBatch(Message):
    type: Literal["stored_work_batch"] = "stored_work_batch"
    max_body_bytes: ClassVar[int] = 15 << 20
    step: int = Field(-1, ge=-1, le=MAX_INT64)
    """The trainer step these units belong to (-1: not a batch, work to verify)."""
    items: list[StoredWork] = Field(max_length=65_536)
    """The work units (for a batch: all assigned to `step` so far)."""


class VerdictBatch(Message):
    type: Literal["verdict_batch"] = "verdict_batch"
    max_body_bytes: ClassVar[int] = 4 << 20
    verdicts: list["Verdict"] = Field(max_length=65_536)
    """Verdicts on work units, signed (with the envelope) by the validator."""


class PublishPolicy(Message):
    """Trainer -> coordinator: version `version` is published under this manifest; announce it."""

    type: Literal["publish_policy"] = "publish_policy"
    version: int = Field(ge=0, le=MAX_INT64)
    """The new policy version."""
    manifest_hash: Hex32
    """sha256 of its shardcast manifest."""


class SubmissionReceipt(Message):
    type: Literal["submission_receipt"] = "submission_receipt"
    work_id: int = Field(ge=0, le=MAX_INT64)
    """The work id this receipt answers."""
    accepted: bool
    """True once the rollout is durably stored (also for an identical retry)."""
    duplicate: bool = False
    """True when this exact rollout had already been accepted (an idempotent retry)."""


class Refusal(Message):
    type: Literal["refusal"] = "refusal"
    reason: Annotated[str, Field(max_length=64)]
    """Stable code: the name of a `protocol.errors.Refused` subclass."""
    detail: Reason = ""
    """Human-readable explanation."""


class WorkCancel(Message):
    type: Literal["work_cancel"] = "work_cancel"
    work_ids: list[Annotated[int, Field(ge=0, le=MAX_INT64)]] = Field(max_length=65_536)
    """Leases that can no longer finish within the off-policy bound; stop working on them."""
    policy_version: int = Field(ge=0, le=MAX_INT64)
    """The version whose arrival made them stale."""


class Verdict(Message):
    type: Literal["verdict"] = "verdict"
    work_id: int = Field(ge=0, le=MAX_INT64)
    """The rollout judged."""
    submitter: PeerIdStr
    """Who submitted it."""
    valid: bool
    """Whether every check passed."""
    reason: Reason = ""
    """Which check failed, if any."""
    severity: Literal["proof", "borderline"] = "proof"
    """Of a failing verdict: `proof` (a deterministic check, or a numeric one far past its tolerance:
    the submitter is banned) or `borderline` (near a tolerance: a strike; `STRIKES_TO_BAN` ban)."""


class Ban(Message):
    type: Literal["ban"] = "ban"
    peer_id: PeerIdStr
    """The banned member."""
    reason: Reason
    """Why (e.g. the failing verdict)."""
    until: float | None = None
    """Unix time the ban ends; None: for the rest of the run."""


class Ok(Message):
    type: Literal["ok"] = "ok"


class JoinAgain(Message):
    """Coordinator -> everyone (gossip): a heartbeat of `peer_id` was refused because it is not a member
    (ejected as dead, or never joined this coordinator's state); that member joins again."""

    type: Literal["join_again"] = "join_again"
    peer_id: PeerIdStr
    """The member whose heartbeat was refused."""
    heartbeat_seq: int = Field(ge=0, le=MAX_INT64)
    """The refused heartbeat's seq: a member that has joined since (after beating that seq) ignores it."""
    reason: Reason = ""
    """Why it is not a member (for logs)."""


VerdictBatch.model_rebuild()


AnyMessage = Annotated[
    Union[RunSpec, Join, JoinAccepted, Heartbeat, Leave, PolicyAnnounce, LeaseGrant,
          RolloutSubmission, SubmissionReceipt, Refusal, WorkCancel, Verdict, Ban, Ok, RolloutGroup,
          LeaseBatchRequest, LeaseGrants, BatchRequest, VerifyRequest, StoredWorkBatch, VerdictBatch, PublishPolicy,
          RunEnd, BatchRejects, JoinAgain],
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter = TypeAdapter(AnyMessage)
MESSAGE_TYPES: tuple[type[Message], ...] = (RunSpec, Join, JoinAccepted, Heartbeat, Leave, PolicyAnnounce,
                                            LeaseGrant, RolloutSubmission, SubmissionReceipt,
                                            Refusal, WorkCancel, Verdict, Ban, Ok, RolloutGroup, LeaseBatchRequest,
                                            LeaseGrants, BatchRequest, VerifyRequest, StoredWorkBatch, VerdictBatch,
                                            PublishPolicy, RunEnd, BatchRejects, JoinAgain)
MAX_BODY_BYTES = max(t.max_body_bytes for t in MESSAGE_TYPES)


def encode_message(message: Message) -> bytes:
    """The one wire form: compact JSON, fields in declaration order (deterministic)."""
    return message.model_dump_json().encode()


def decode_message(body: bytes) -> Message:
    """Parse and validate; raise `MessageTooLarge` or `MalformedMessage` for anything unacceptable."""
    if len(body) > MAX_BODY_BYTES:
        raise MessageTooLarge(f"message body of {len(body)} bytes exceeds {MAX_BODY_BYTES}")
    try:
        message = _ADAPTER.validate_json(body)
    except ValidationError as exc:
        raise MalformedMessage(f"invalid message: {exc.error_count()} error(s): {_first_error(exc)}") from None
    except (ValueError, RecursionError) as exc:  # non-UTF-8 input and the like
        raise MalformedMessage(f"undecodable message: {exc}") from None
    if len(body) > message.max_body_bytes:
        raise MessageTooLarge(f"{message.type} body of {len(body)} bytes exceeds {message.max_body_bytes}")
    return message


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False, include_input=False)[0]
    return f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"[:300]
