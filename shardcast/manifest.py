"""The signed manifest of one policy version: what a fetcher trusts, and nothing else.

Invariant: a fetcher accepts bytes only if they hash to what a manifest says, and accepts a
manifest only if a trusted publisher signed its canonical bytes. A manifest that parses is
also internally consistent (shard sizes tile the payload, tensors lie inside it), so a hostile
one cannot make a fetcher allocate or index beyond what it declares.

A version is published in two steps (`shardcast.publish.publish_stream`): first its content alone
(tensors, shard sizes and raw hashes: a *local* manifest, no wire encoding yet), which processes
sharing the publisher's store can load at once; then the wire shards and the whole manifest, which
fetchers elsewhere need. `manifest_hash`, what the coordinator announces, is the hash of the content
without the wire fields, so it is the same for both; the wire fields are covered by the signature.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from protocol.identity import NodeKey, peer_id_from_public_bytes, verify
from shardcast.errors import InvalidManifest, UnknownPublisher
from shardcast.hashing import HASH_NAME, content_hash

MAX_SHARDS = 1 << 16
"""Refuse manifests with more shards (64k x 64 MiB = 4 TiB): bounds memory a manifest can claim."""
MAX_TENSORS = 1 << 20
"""Refuse manifests with more tensors (the largest MoE checkpoints have ~10^5)."""
MAX_MANIFEST_BYTES = 256 << 20
"""Refuse manifest documents larger than this before parsing them."""


class TensorEntry(BaseModel):
    """Where one tensor lives in the version's flat byte payload."""

    name: str
    """Parameter name as in the state dict (HF naming)."""
    dtype: str = Field(pattern=r"^[a-z0-9_]+$")
    """torch dtype name without the `torch.` prefix, e.g. `bfloat16`."""
    shape: list[int]
    """Tensor shape."""
    offset: int = Field(ge=0)
    """Byte offset in the flat payload (aligned to 64 bytes)."""
    nbytes: int = Field(ge=0)
    """Byte length (numel * element size)."""


class ShardEntry(BaseModel):
    """One shard: a fixed-size range of the flat payload, as sent on the wire."""

    index: int = Field(ge=0)
    """Position of the shard; shard i covers payload bytes [i*shard_size, i*shard_size+raw_size)."""
    raw_size: int = Field(ge=0)
    """Bytes of the full-version payload this shard covers."""
    wire_size: int | None = Field(default=None, ge=0)
    """Bytes sent on the wire (zstd frame of the raw bytes, or of raw XOR parent for a delta); None in a
    local manifest (the wire shards not encoded yet)."""
    wire_hash: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """Hash of the wire bytes: checked on arrival, before decompressing; None in a local manifest."""
    raw_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Hash of the reconstructed full-version bytes: checked after decoding (and after un-XOR)."""


class Manifest(BaseModel):
    """Everything a fetcher needs to fetch, verify and rebuild one policy version."""

    format: Literal["primerl-shardcast/1"] = "primerl-shardcast/1"
    """Format tag; bumps when the layout changes."""
    run_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    """The run this version belongs to."""
    version: int = Field(ge=0)
    """Policy version (trainer step)."""
    parent: int | None = Field(default=None, ge=0)
    """Previous version; a delta is encoded against it."""
    encoding: Literal["full", "delta"]
    """`full`: wire = zstd(raw); `delta`: wire = zstd(raw XOR parent raw)."""
    keyframe: int = Field(ge=0)
    """The full version this version's delta chain starts from (itself when full)."""
    hash_name: Literal["blake3"] = HASH_NAME
    """Hash function of every hash in this manifest."""
    shard_size: int = Field(ge=4096, le=1 << 34)
    """Raw bytes per shard (the last may be shorter)."""
    total_bytes: int = Field(ge=0)
    """Length of the flat payload."""
    tensors: list[TensorEntry]
    """Tensor index."""
    shards: list[ShardEntry]
    """Shard list, in order."""

    @model_validator(mode="after")
    def _consistent(self) -> "Manifest":
        if len(self.shards) > MAX_SHARDS or len(self.tensors) > MAX_TENSORS:
            raise ValueError("too many shards or tensors")
        if self.encoding == "delta":
            if self.parent is None or self.parent >= self.version or self.keyframe > self.parent:
                raise ValueError("a delta needs parent < version and keyframe <= parent")
        elif self.keyframe != self.version:
            raise ValueError("a full version is its own keyframe")
        expected = -(-self.total_bytes // self.shard_size)
        if len(self.shards) != expected:
            raise ValueError(f"{len(self.shards)} shards for {self.total_bytes} bytes; expected {expected}")
        for i, s in enumerate(self.shards):
            want = min(self.shard_size, self.total_bytes - i * self.shard_size)
            if s.index != i or s.raw_size != want:
                raise ValueError(f"shard {i}: index {s.index}, raw_size {s.raw_size}; expected {i}, {want}")
            if (s.wire_size is None) != (s.wire_hash is None):
                raise ValueError(f"shard {i}: a wire size without a wire hash, or the other way")
            # zstd's worst case is raw + raw/128 + a small header; anything larger is a lie.
            if s.wire_size is not None and s.wire_size > want + (want >> 7) + 1024:
                raise ValueError(f"shard {i}: wire_size {s.wire_size} exceeds zstd's bound")
        for t in self.tensors:
            if t.offset + t.nbytes > self.total_bytes or any(d < 0 for d in t.shape):
                raise ValueError(f"tensor {t.name} lies outside the payload")
        return self

    def canonical_bytes(self) -> bytes:
        """The exact bytes that are signed and hashed: sorted-key compact JSON."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()

    def manifest_hash(self) -> str:
        """Hash of the version's content, announced over gossip (`PolicyAnnounce.manifest_hash`): the
        canonical bytes without the shards' wire fields, so a local manifest and the whole one it becomes
        hash the same (the signature covers the wire fields)."""
        doc = self.model_dump(mode="json")
        doc["shards"] = [{k: v for k, v in s.items() if k not in _WIRE_FIELDS} for s in doc["shards"]]
        return content_hash(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())

    @property
    def wire_complete(self) -> bool:
        """Whether every shard's wire size and hash are here (what a fetcher from elsewhere needs)."""
        return all(s.wire_hash is not None for s in self.shards)

    def with_wire(self, shards: list[ShardEntry]) -> "Manifest":
        """This manifest with the wire fields of `shards` (same indices, sizes and raw hashes)."""
        if [(s.index, s.raw_size, s.raw_hash) for s in shards] != [(s.index, s.raw_size, s.raw_hash) for s in self.shards]:
            raise ValueError("the wire shards are not this manifest's")
        return self.model_copy(update={"shards": shards})

    @property
    def wire_bytes(self) -> int:
        return sum(s.wire_size or 0 for s in self.shards)


_WIRE_FIELDS = ("wire_size", "wire_hash")


class SignedManifest(BaseModel):
    """A manifest with the publisher's Ed25519 public key and signature (hex)."""

    manifest: Manifest
    """The signed content."""
    publisher: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Publisher's Ed25519 public key, hex."""
    signature: str = Field(pattern=r"^[0-9a-f]{128}$")
    """Ed25519 signature of `manifest.canonical_bytes()`, hex."""

    @classmethod
    def sign(cls, manifest: Manifest, key: NodeKey) -> "SignedManifest":
        return cls(manifest=manifest, publisher=key.public_bytes.hex(), signature=key.sign(manifest.canonical_bytes()).hex())

    @property
    def publisher_peer_id(self) -> str:
        return peer_id_from_public_bytes(bytes.fromhex(self.publisher))

    def verified(self, trusted: "TrustedPublishers") -> Manifest:
        """The manifest, if a trusted publisher signed it; else `UnknownPublisher`/`InvalidSignature`."""
        if not trusted.allows(self.publisher):
            raise UnknownPublisher(f"manifest signed by {self.publisher_peer_id}, not a trusted publisher")
        verify(bytes.fromhex(self.publisher), self.manifest.canonical_bytes(), bytes.fromhex(self.signature))
        return self.manifest

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> "SignedManifest":
        """Parse untrusted JSON; any defect is an `InvalidManifest`."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise InvalidManifest(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise InvalidManifest(f"manifest rejected: {exc.error_count()} error(s): {exc.errors()[0]['msg']}") from exc


class TrustedPublishers:
    """The publisher keys a node accepts manifests from (hex public keys or libp2p peer ids)."""

    def __init__(self, keys: list[str | bytes]):
        self._hex: set[str] = set()
        self._peer_ids: set[str] = set()
        for k in keys:
            if isinstance(k, bytes):
                self._hex.add(k.hex())
            elif len(k) == 64 and all(c in "0123456789abcdef" for c in k):
                self._hex.add(k)
            else:
                self._peer_ids.add(k)
        if not self._hex and not self._peer_ids:
            raise ValueError("at least one trusted publisher is required")

    def allows(self, publisher_hex: str) -> bool:
        if publisher_hex in self._hex:
            return True
        return bool(self._peer_ids) and peer_id_from_public_bytes(bytes.fromhex(publisher_hex)) in self._peer_ids
