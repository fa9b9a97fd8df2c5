"""Typed errors for everything a peer can send us wrong.

Every failure at a trust boundary raises a subclass of `ProtocolError`; the node catches these
where it decides what to do (log the peer and the reason, drop the message, maybe penalise), so
a bad message never brings a node down.
"""


class ProtocolError(Exception):
    """Base class: something a peer sent, or a file we read, is not acceptable."""


class InvalidKeyFile(ProtocolError):
    """A key file is missing, malformed, or readable by others."""


class InvalidSignature(ProtocolError):
    """A signature does not verify under the claimed public key."""


class MalformedMessage(ProtocolError):
    """Bytes that do not decode to a known, well-formed message (truncated, random, bad fields)."""


class UnexpectedReply(MalformedMessage):
    """A well-formed reply of another type than the request asks for (protocol/client.py)."""


class MessageTooLarge(ProtocolError):
    """A frame, envelope or message body over its size limit."""


class WrongRun(ProtocolError):
    """A message signed for another run id."""


class ExpiredMessage(ProtocolError):
    """A message whose timestamp is outside the accepted clock window."""


class ReplayedMessage(ProtocolError):
    """A (signer, nonce) pair already seen inside the freshness window."""


class SignerMismatch(ProtocolError):
    """A request envelope signed by someone other than the authenticated peer on the stream."""


class UnsupportedRequest(ProtocolError):
    """A request type this node does not answer."""


class TransportError(ProtocolError):
    """A peer could not be reached, or a stream broke before a full reply came back."""


class RequestTimeout(TransportError):
    """A request got no reply within its timeout."""


class Refused(ProtocolError):
    """The coordinator refused a request; `reason` is a stable code (the subclass name, or the
    name of the envelope-level error the other side raised)."""

    def __init__(self, detail: str = "", reason: str | None = None):
        super().__init__(detail)
        self.reason = reason or type(self).__name__


class NotMember(Refused):
    """The signer has not joined the run (or was ejected as dead)."""


class NotAuthorized(Refused):
    """The signer is a member, but not one the signed spec lets do this (judge work, publish weights)."""


class BannedPeer(Refused):
    """The signer is banned from the run."""


class SpecMismatch(Refused):
    """A join names a run spec hash other than the coordinator's."""


class UnknownLease(Refused):
    """A submission names a work id that was never granted."""


class NotLeaseHolder(Refused):
    """A submission for a work id leased to someone else (e.g. re-granted after expiry)."""


class LeaseExpired(Refused):
    """A submission after its lease deadline, or for work cancelled as too stale to finish."""


class DuplicateSubmission(Refused):
    """A submission for a work id whose result was already accepted."""


class StaleRollout(Refused):
    """A rollout whose oldest token version is more than `max_off_policy_steps` behind."""


class InconsistentRollout(Refused):
    """A rollout whose version runs, tokens and logprobs do not line up."""


class UnpublishedVersion(StaleRollout):
    """A rollout claiming, for any of its tokens, a policy version that has not been published (a
    version from the future: no honest node can hold it). Counted against the submitter."""


class MalformedWork(Refused):
    """A work unit of the wrong type or shape for the run: a bare submission where the run expects a
    group, a group of another size than the spec's, or tokens no model of the run can read.
    Counted against the submitter."""


class UnknownWork(Refused):
    """A report on a work unit that is not in the batch it names."""


REFUSALS: dict[str, type[Refused]] = {
    cls.__name__: cls
    for cls in (NotMember, NotAuthorized, BannedPeer, SpecMismatch, UnknownLease, NotLeaseHolder, LeaseExpired,
                DuplicateSubmission, StaleRollout, InconsistentRollout, UnpublishedVersion, MalformedWork, UnknownWork)
}


class InvalidProof(ProtocolError):
    """A rollout's proof (or claim) is malformed: wrong length, out-of-range field, inconsistent spans."""


class RateLimited(ProtocolError):
    """A peer over its request rate, requests in flight or bytes in flight (protocol/limits.py)."""
