"""`primerl-node keygen`: create a node key file (Ed25519, mode 0600) and print the node id."""

from __future__ import annotations

import argparse

from protocol.identity import NodeKey


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keygen", help="create an Ed25519 node key; prints the node id (libp2p PeerID)")
    p.add_argument("--out", required=True, help="key file to write (refuses to overwrite)")
    p.set_defaults(func=_keygen)


def _keygen(args: argparse.Namespace) -> int:
    from pathlib import Path

    if Path(args.out).exists():
        raise SystemExit(f"{args.out} exists; refusing to overwrite a key")
    key = NodeKey.generate()
    key.save(args.out)
    print(key.peer_id)
    return 0
