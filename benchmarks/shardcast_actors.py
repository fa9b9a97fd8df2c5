"""Processes the shardcast benchmark drives: our origin and clients, and the peer's (shardcast
0.3.2, run from its own venv). Each prints `ready [PORT]` once set up, waits for `go` on stdin,
prints `done SECONDS` once it holds the verified file, and exits when stdin closes.
Run as `python -m benchmarks.shardcast_actors ours-origin|ours-client ...`; the peer's scripts
are strings run by the peer's interpreter (its package is also named `shardcast`)."""

from __future__ import annotations

import asyncio
import sys
import time

PEER_ORIGIN = r'''
import os, sys, shardcast, shardcast.server as srv
_init = srv.ShardcastServer.__init__
def _local(self, addr, *a, **k):  # the peer binds 0.0.0.0; keep the benchmark on loopback
    _init(self, ("127.0.0.1", addr[1]), *a, **k)
srv.ShardcastServer.__init__ = _local
data_dir, port, payload, uplink = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
if uplink > 0:  # emulate a thin uplink exactly as our server's pacing does (one request at a time here)
    import time
    def _paced(self, src, dst, rate=uplink * 2**20, chunk=256 << 10):
        free_at = time.monotonic()
        while True:
            buf = src.read(chunk)
            if not buf:
                return
            free_at = max(free_at, time.monotonic()) + len(buf) / rate
            time.sleep(max(0.0, free_at - len(buf) / rate - time.monotonic()))
            dst.write(buf)
    srv.ShardcastRequestHandler.copyfile = _paced
shardcast.initialize(data_dir, port=port)
with open(os.path.join(data_dir, "data1.bin"), "wb") as f:  # clients probe it; the origin never writes it
    f.write(os.urandom(1 << 20))
version = shardcast.broadcast(payload)
print("ready", version, flush=True)
sys.stdin.read()
shardcast.shutdown()
'''

PEER_CLIENT = r'''
import sys, time
from shardcast import ClientNode
url, out_dir, version = sys.argv[1], sys.argv[2], sys.argv[3]
client = ClientNode([url], out_dir)
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
# Its single-threaded origin drops connections under concurrent clients, and download_version
# then gives up at once ("No versions available"); retry it so it can finish at all.
for attempt in range(1, 41):
    path = client.download_version(version, out_dir + "/file.bin")
    if path:
        break
    time.sleep(0.25)
print("done" if path else "failed", time.perf_counter() - t0, attempt, flush=True)
sys.stdin.read()
'''


async def _stdin_line() -> str:
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def ours_origin(store_dir: str, uplink_mibps: float, seed_copies: int = 0) -> None:
    from shardcast.seeding import SeedOffer
    from shardcast.server import ShardServer
    from shardcast.store import Store

    server = ShardServer(Store(store_dir), uplink_bytes_per_s=uplink_mibps * 2**20 if uplink_mibps > 0 else None,
                         seed=SeedOffer(seed_copies) if seed_copies > 0 else None)
    port = await server.start("127.0.0.1", 0)
    print("ready", port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop()


async def ours_client(store_dir: str, run_id: str, version: int, trust: str) -> None:
    from shardcast.fetch import fetch_version
    from shardcast.manifest import TrustedPublishers
    from shardcast.server import ShardServer
    from shardcast.store import Store

    store = Store(store_dir)
    server = ShardServer(store)  # peer mode: serve verified shards while fetching
    port = await server.start("127.0.0.1", 0)
    print("ready", port, flush=True)
    sources = (await _stdin_line()).split()[1:]  # "go URL..."; first is the origin
    t0 = time.perf_counter()
    got = await fetch_version(store, sources, TrustedPublishers([trust]), run_id, version)
    print("done", time.perf_counter() - t0, got.wire_bytes_downloaded, server.bytes_served, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    print("served", server.bytes_served, flush=True)
    await server.stop()


if __name__ == "__main__":
    role, args = sys.argv[1], sys.argv[2:]
    if role == "ours-origin":
        asyncio.run(ours_origin(args[0], float(args[1]), int(args[2]) if len(args) > 2 else 0))
    elif role == "ours-client":
        asyncio.run(ours_client(args[0], args[1], int(args[2]), args[3]))
    else:
        raise SystemExit(f"unknown role {role}")
