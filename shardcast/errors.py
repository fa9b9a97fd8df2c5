"""Typed failures of weight distribution. All are `ProtocolError`s: a peer or a file sent us
something unacceptable; the fetcher catches them per source, logs the source and the reason,
and fetches the shard elsewhere. Only `FetchFailed` reaches the caller."""

from protocol.errors import InvalidSignature, ProtocolError

__all__ = [
    "InvalidSignature",
    "ShardcastError",
    "InvalidManifest",
    "UnknownPublisher",
    "CorruptShard",
    "TruncatedShard",
    "InvalidSparseDelta",
    "SourceUnavailable",
    "SourceBusy",
    "NotOffered",
    "FetchFailed",
    "VersionNotFound",
]


class ShardcastError(ProtocolError):
    """Base class of shardcast failures."""


class InvalidManifest(ShardcastError):
    """A manifest does not parse or is internally inconsistent (sizes, offsets, versions)."""


class UnknownPublisher(ShardcastError):
    """A manifest is signed by a key that is not among the trusted publishers."""


class CorruptShard(ShardcastError):
    """Shard bytes do not match the hash (or size) the signed manifest promises."""


class TruncatedShard(CorruptShard):
    """A source closed the connection before sending the whole shard."""


class InvalidSparseDelta(CorruptShard):
    """A sparse delta shard is malformed: indices outside the shard, repeated or unsorted, or a
    section that does not decode to the size its header claims."""


class SourceUnavailable(ShardcastError):
    """A source refused, stalled past its timeout, or answered with an HTTP error."""


class SourceBusy(SourceUnavailable):
    """A source answered 503 (all its upload slots taken): try elsewhere or later, no penalty."""


class NotOffered(SourceUnavailable):
    """A super-seeding origin answered 425: it handed this shard out already; fetch it from a peer."""


class VersionNotFound(ShardcastError):
    """No source (or the local store) holds the requested version."""


class FetchFailed(ShardcastError):
    """A version could not be fetched within the retry budget; says which shards and why."""
