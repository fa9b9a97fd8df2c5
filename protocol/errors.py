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
