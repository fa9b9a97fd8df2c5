"""Node identity: one Ed25519 key per node; the node id is the libp2p PeerID of that key.

The PeerID is computed here from the public key alone (identity multihash of the protobuf-encoded
Ed25519 public key, base58btc), so it equals what py-libp2p derives for the same key; the
transport builds its libp2p key pair from `NodeKey.private_bytes()`.
Key files hold the raw 32-byte seed, PEM-wrapped (PKCS#8), with mode 0600.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature as _CryptoInvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.errors import InvalidKeyFile, InvalidSignature

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
# libp2p crypto.proto: KeyType Ed25519 = 1; PublicKey{Type=1 (field 1, varint), Data (field 2, bytes)}
_PB_ED25519_PUBKEY_PREFIX = bytes([0x08, 0x01, 0x12, 0x20])
_MULTIHASH_IDENTITY = 0x00


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def peer_id_from_public_bytes(public: bytes) -> str:
    """libp2p PeerID (base58) of a 32-byte Ed25519 public key."""
    if len(public) != 32:
        raise InvalidSignature(f"Ed25519 public key must be 32 bytes, got {len(public)}")
    encoded = _PB_ED25519_PUBKEY_PREFIX + public
    return b58encode(bytes([_MULTIHASH_IDENTITY, len(encoded)]) + encoded)


def verify(public: bytes, message: bytes, signature: bytes) -> None:
    """Raise `InvalidSignature` unless `signature` is `public`'s Ed25519 signature of `message`."""
    if len(public) != 32 or len(signature) != 64:
        raise InvalidSignature("malformed public key or signature length")
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except _CryptoInvalidSignature as exc:
        raise InvalidSignature("signature does not verify") from exc


class NodeKey:
    """An Ed25519 private key with the node id it implies."""

    def __init__(self, private: Ed25519PrivateKey):
        self._private = private
        self.public_bytes: bytes = private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id: str = peer_id_from_public_bytes(self.public_bytes)

    @classmethod
    def generate(cls) -> "NodeKey":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> "NodeKey":
        """Deterministic key from a 32-byte seed (tests and simulations)."""
        if len(seed) != 32:
            raise InvalidKeyFile("Ed25519 seed must be 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def private_bytes(self) -> bytes:
        return self._private.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    def sign(self, message: bytes) -> bytes:
        return self._private.sign(message)

    def save(self, path: str | Path) -> None:
        """Write the key as PEM with mode 0600 (created so; never world-readable in between)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = self._private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        os.chmod(path, 0o600)

    @classmethod
    def load(cls, path: str | Path) -> "NodeKey":
        """Read a key file; refuse one that group or others can read."""
        path = Path(path)
        try:
            mode = path.stat().st_mode
            data = path.read_bytes()
        except OSError as exc:
            raise InvalidKeyFile(f"cannot read key file {path}: {exc}") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise InvalidKeyFile(f"key file {path} is accessible by group/others (mode {oct(mode & 0o777)}); chmod 600 it")
        try:
            private = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise InvalidKeyFile(f"key file {path} is not a PEM private key: {exc}") from exc
        if not isinstance(private, Ed25519PrivateKey):
            raise InvalidKeyFile(f"key file {path} holds a {type(private).__name__}, not Ed25519")
        return cls(private)

    @classmethod
    def load_or_create(cls, path: str | Path) -> "NodeKey":
        path = Path(path)
        if path.exists():
            return cls.load(path)
        key = cls.generate()
        key.save(path)
        return key
