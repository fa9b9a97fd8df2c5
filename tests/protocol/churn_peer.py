"""An attacker process for tests/protocol/test_connection_churn.py: identities that connect to a
peer and disconnect again, in a loop, each on its own libp2p host, all at once.

    python tests/protocol/churn_peer.py ADDR --identities N --cycles C --report out.json

The report says how many cycles each identity made and how many connects failed."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from protocol.errors import ProtocolError  # noqa: E402
from protocol.identity import NodeKey  # noqa: E402
from protocol.transport import PeerHost, peer_info  # noqa: E402


async def churn(addr: str, cycles: int) -> dict:
    host = PeerHost(NodeKey.generate())
    await host.start()
    target = str(peer_info(addr).peer_id)
    made = failed = 0
    try:
        for _ in range(cycles):
            try:
                await host.connect(addr, timeout=5)
                made += 1
            except ProtocolError:
                failed += 1
            try:
                await host.disconnect(target)
            except ProtocolError:
                pass
    finally:
        await host.stop()
    return {"peer_id": host.peer_id, "connected": made, "failed": failed}


async def main(args: argparse.Namespace) -> None:
    t0 = time.monotonic()
    results = await asyncio.gather(*(churn(args.addr, args.cycles) for _ in range(args.identities)))
    Path(args.report).write_text(json.dumps({"identities": results, "seconds": time.monotonic() - t0}))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("addr")
    p.add_argument("--identities", type=int, default=1)
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--report", required=True)
    asyncio.run(asyncio.wait_for(main(p.parse_args()), 300))
