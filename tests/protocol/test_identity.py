"""Node identity: key files with safe permissions, `primerl-node keygen`, node id = libp2p PeerID."""

from __future__ import annotations

import os

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from node.cli import main as cli_main
from protocol.errors import InvalidKeyFile, InvalidSignature
from protocol.identity import NodeKey, verify


def test_keygen_writes_a_private_key_file_and_prints_the_node_id(tmp_path, capsys):
    path = tmp_path / "node.key"
    assert cli_main(["keygen", "--out", str(path)]) == 0
    printed = capsys.readouterr().out.strip()
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert NodeKey.load(path).peer_id == printed
    with pytest.raises(SystemExit):  # never overwrites a key
        cli_main(["keygen", "--out", str(path)])


def test_key_readable_by_others_is_refused(tmp_path):
    path = tmp_path / "k"
    NodeKey.generate().save(path)
    os.chmod(path, 0o644)
    with pytest.raises(InvalidKeyFile):
        NodeKey.load(path)
    path.write_bytes(b"not a key")
    os.chmod(path, 0o600)
    with pytest.raises(InvalidKeyFile):
        NodeKey.load(path)


def test_node_id_is_the_libp2p_peer_id_of_the_same_key():
    for seed in (b"\x00" * 32, b"\x01" * 32, os.urandom(32)):
        key = NodeKey.from_seed(seed)
        pair = create_new_key_pair(key.private_bytes())
        assert str(ID.from_pubkey(pair.public_key)) == key.peer_id


def test_signatures_verify_only_for_the_signer():
    a, b = NodeKey.generate(), NodeKey.generate()
    sig = a.sign(b"msg")
    verify(a.public_bytes, b"msg", sig)
    with pytest.raises(InvalidSignature):
        verify(b.public_bytes, b"msg", sig)
    with pytest.raises(InvalidSignature):
        verify(a.public_bytes, b"msg!", sig)
