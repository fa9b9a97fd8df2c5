"""Signed verdicts and the sampling rate at which submissions are verified.

A verdict names the claim by digest, says accept or reject with a reason code and, on reject, the
failing chunk or token; the validator signs its canonical JSON with its node key, so anyone can
check who judged what. Which submissions get verified is a keyed hash of the work id: a node cannot
predict it without the validator's secret, and the validator cannot pick favourites after seeing
a claim. Verifying each submission with probability r, a node that cheats on c submissions
escapes with probability (1 - r)^c: r = 0.1 catches 10 cheats with probability 0.65, 50 with
0.995 (see docs/verification.md).
"""

from __future__ import annotations

import hashlib
import hmac
import math

from pydantic import BaseModel, ConfigDict, Field

from protocol.errors import InvalidSignature
from protocol.identity import NodeKey, peer_id_from_public_bytes, verify
from verification.reasons import Reason, Severity


class Verdict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    work_id: int = Field(ge=0)
    """The rollout judged."""
    claim_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    """sha256 of the claim's canonical JSON."""
    accepted: bool
    """True when every check passed."""
    reason: Reason
    """`ok`, or the first failing check."""
    chunk: int | None = None
    """Failing proof chunk (token order), when the reason is per chunk."""
    token: int | None = None
    """Failing completion token, when the reason is per token."""
    severity: Severity = Severity.NONE
    """On reject: `proof` (ban-grade evidence) or `borderline` (a strike); `none` when accepted."""
    detail: str = Field("", max_length=512)
    """Human-readable figures behind the reason."""
    validator: str = ""
    """Peer id of the signer."""
    public_key: str = ""
    """Hex Ed25519 public key of the signer."""
    signature: str = ""
    """Hex signature over `signing_bytes()`."""

    def signing_bytes(self) -> bytes:
        return self.model_dump_json(exclude={"signature"}).encode()

    def signed(self, key: NodeKey) -> "Verdict":
        unsigned = self.model_copy(update={"validator": key.peer_id, "public_key": key.public_bytes.hex(), "signature": ""})
        return unsigned.model_copy(update={"signature": key.sign(unsigned.signing_bytes()).hex()})

    def check_signature(self) -> None:
        """Raise `InvalidSignature` unless signed by the key it names, whose peer id it names."""
        try:
            public, sig = bytes.fromhex(self.public_key), bytes.fromhex(self.signature)
        except ValueError as exc:
            raise InvalidSignature("verdict key or signature is not hex") from exc
        if peer_id_from_public_bytes(public) != self.validator:
            raise InvalidSignature("verdict names a validator other than its key's")
        verify(public, self.signing_bytes(), sig)


def selected_for_verification(work_id: int, rate: float, secret: bytes) -> bool:
    """Whether the validator verifies this work id, at `rate` in [0, 1], keyed by its secret."""
    if rate >= 1:
        return True
    h = hmac.new(secret, work_id.to_bytes(8, "big"), hashlib.sha256).digest()
    return int.from_bytes(h[:8], "big") < rate * 2**64


def detection_probability(rate: float, cheated: int, per_check: float = 1.0) -> float:
    """Chance that at least one of `cheated` submissions is verified and caught, when each is
    verified with probability `rate` and a verified cheat is caught with probability `per_check`."""
    return 1.0 - math.pow(1.0 - rate * per_check, cheated)
