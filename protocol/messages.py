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

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from protocol.errors import MalformedMessage, MessageTooLarge

Role = Literal["coordinator", "inference", "trainer", "validator", "relay"]
PeerIdStr = Annotated[str, Field(min_length=1, max_length=128)]
Multiaddr = Annotated[str, Field(min_length=1, max_length=256)]
Hex32 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Reason = Annotated[str, Field(max_length=512)]

MAX_ROLLOUT_TOKENS = 131_072
"""Longest completion a submission may carry (128 Ki tokens: long-context RL, still < 4 MiB JSON)."""
MAX_PROOF_BYTES = 1 << 20
"""258 bytes per 32-token chunk (TOPLOC-style) x 4096 chunks = ~1 MiB covers MAX_ROLLOUT_TOKENS."""


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
    model: Annotated[str, Field(max_length=256)] = ""
    """Model the run trains (name or manifest reference)."""
    environment: Annotated[str, Field(max_length=256)] = ""
    """Environment (task family) rollouts come from."""
    max_off_policy_steps: int = Field(1, ge=0, le=1024)
    """k: a rollout with any token older than (current version - k) never enters a batch."""
    heartbeat_interval_s: float = Field(10.0, gt=0, le=3600)
    """How often members announce themselves."""
    dead_after_missed: int = Field(3, ge=1, le=100)
    """Missed heartbeats after which a member is dead and its leases go back to the pool."""
    lease_ttl_s: float = Field(300.0, gt=0, le=86_400)
    """How long a work lease lasts before it is re-granted to someone else."""
    tasks_per_step: int = Field(1 << 20, ge=1)
    """Size of the task pool work ids draw from (task index = derived seed mod this)."""

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
    policy_version: int = Field(ge=-1)
    """Latest published policy version (-1: none yet)."""
    members: list[PeerAddress] = Field(default_factory=list, max_length=4096)
    """Live members and where they listen: peers are found through the coordinator, then gossip."""


class Heartbeat(Message):
    type: Literal["heartbeat"] = "heartbeat"
    seq: int = Field(ge=0)
    """Counts up per sender; lets a reader drop reordered beats."""
    role: Role
    """The sender's role."""
    addrs: list[Multiaddr] = Field(default_factory=list, max_length=16)
    """Where the sender listens (gossip spreads addresses: peer discovery)."""


class Leave(Message):
    type: Literal["leave"] = "leave"
    reason: Reason = ""
    """Why the member leaves (free text, for logs)."""


class PolicyAnnounce(Message):
    type: Literal["policy_announce"] = "policy_announce"
    version: int = Field(ge=0)
    """The new policy version (= the trainer step that produced it)."""
    manifest_hash: Hex32
    """sha256 of the shardcast manifest for this version."""
    parent_version: int = Field(-1, ge=-1)
    """Version a delta applies to (-1: full weights)."""


class LeaseRequest(Message):
    type: Literal["lease_request"] = "lease_request"
    policy_version: int = Field(ge=-1)
    """Newest policy version the requester holds; work is granted at the coordinator's version."""


class LeaseGrant(Message):
    type: Literal["lease_grant"] = "lease_grant"
    work_id: int = Field(ge=0)
    """Unique per run; results are accepted exactly once per work id."""
    holder: PeerIdStr
    """Who may submit the result."""
    policy_version: int = Field(ge=-1)
    """Coordinator's version when the work was first minted."""
    task_index: int = Field(ge=0)
    """Which task of the environment (derived, not chosen)."""
    seed: int = Field(ge=0, lt=1 << 64)
    """Sampling seed root (derived from run, step, work id)."""
    deadline: float = Field(gt=0)
    """Unix time after which the lease is re-granted and a submission refused."""


class RolloutSubmission(Message):
    type: Literal["rollout_submission"] = "rollout_submission"
    max_body_bytes: ClassVar[int] = 8 << 20
    work_id: int = Field(ge=0)
    """The leased work this rollout answers."""
    version_runs: list[tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=1)]]] = Field(min_length=1, max_length=4096)
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

    @model_validator(mode="after")
    def _lines_up(self) -> "RolloutSubmission":
        n = len(self.token_ids)
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


class SubmissionReceipt(Message):
    type: Literal["submission_receipt"] = "submission_receipt"
    work_id: int = Field(ge=0)
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
    work_ids: list[Annotated[int, Field(ge=0)]] = Field(max_length=65_536)
    """Leases that can no longer finish within the off-policy bound; stop working on them."""
    policy_version: int = Field(ge=0)
    """The version whose arrival made them stale."""


class Verdict(Message):
    type: Literal["verdict"] = "verdict"
    work_id: int = Field(ge=0)
    """The rollout judged."""
    submitter: PeerIdStr
    """Who submitted it."""
    valid: bool
    """Whether every check passed."""
    reason: Reason = ""
    """Which check failed, if any."""


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


AnyMessage = Annotated[
    Union[RunSpec, Join, JoinAccepted, Heartbeat, Leave, PolicyAnnounce, LeaseRequest, LeaseGrant,
          RolloutSubmission, SubmissionReceipt, Refusal, WorkCancel, Verdict, Ban, Ok],
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter = TypeAdapter(AnyMessage)
MESSAGE_TYPES: tuple[type[Message], ...] = (RunSpec, Join, JoinAccepted, Heartbeat, Leave, PolicyAnnounce,
                                            LeaseRequest, LeaseGrant, RolloutSubmission, SubmissionReceipt,
                                            Refusal, WorkCancel, Verdict, Ban, Ok)
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
