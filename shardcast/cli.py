"""`primerl-node shardcast publish|serve|relay|fetch|ls`: policy-weight distribution by hand.

A typical walk on one machine:
  primerl-node keygen --out trainer.key                       # prints the trainer's node id
  primerl-node shardcast publish --store origin --key trainer.key --run r1 --version 0 --weights ckpt/
  primerl-node shardcast serve --store origin --port 8470
  primerl-node shardcast relay --store relay --upstream http://127.0.0.1:8470 --run r1 --trust <id> --port 8471
  primerl-node shardcast fetch --store me --source http://127.0.0.1:8470 --source http://127.0.0.1:8471 \\
      --run r1 --trust <id> --out weights.safetensors
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from shardcast import DEFAULT_PORT

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("shardcast", help="publish, serve, relay and fetch signed policy versions",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = p.add_subparsers(dest="shardcast_command", metavar="ACTION", required=True)

    pub = cmds.add_parser("publish", help="shard, compress and sign a state dict (safetensors) as version V")
    pub.add_argument("--store", required=True, help="store directory (the origin serves it)")
    pub.add_argument("--key", required=True, help="publisher key file (see `primerl-node keygen`)")
    pub.add_argument("--run", required=True, help="run id")
    pub.add_argument("--version", type=int, required=True, help="policy version (trainer step)")
    pub.add_argument("--parent", type=int, default=None, help="previous version; encode as a delta against it when allowed")
    pub.add_argument("--weights", required=True, help="a .safetensors file, or a checkpoint directory holding *.safetensors")
    pub.add_argument("--shard-mib", type=int, default=64, help="raw shard size in MiB (default 64)")
    pub.add_argument("--keyframe-every", type=int, default=8, help="a full version at least every K versions (default 8)")
    pub.add_argument("--keep-last", type=int, default=4, help="retain the newest R versions (+ their keyframe chain)")
    pub.add_argument("--zstd-level", type=int, default=1, help="zstd level (default 1; higher barely helps on weights)")
    pub.set_defaults(func=_publish)

    srv = cmds.add_parser("serve", help="serve a store over HTTP (origin or peer)")
    _serve_args(srv)
    srv.set_defaults(func=_serve)

    rel = cmds.add_parser("relay", help="mirror a run from upstream sources as versions appear, and serve them")
    _serve_args(rel)
    rel.add_argument("--upstream", action="append", required=True, help="upstream base URL (repeatable)")
    rel.add_argument("--run", required=True, help="run id to mirror")
    rel.add_argument("--trust", action="append", required=True, help="trusted publisher: node id or hex public key (repeatable)")
    rel.add_argument("--keep-last", type=int, default=4, help="retain the newest R versions")
    rel.add_argument("--poll", type=float, default=2.0, help="seconds between upstream polls")
    rel.set_defaults(func=_relay)

    fet = cmds.add_parser("fetch", help="download and verify a version from several sources at once")
    fet.add_argument("--store", required=True, help="local store (resume happens from here)")
    fet.add_argument("--source", action="append", required=True, help="source base URL (repeatable)")
    fet.add_argument("--run", required=True, help="run id")
    fet.add_argument("--version", type=int, default=None, help="version (default: newest any source has)")
    fet.add_argument("--trust", action="append", required=True, help="trusted publisher: node id or hex public key (repeatable)")
    fet.add_argument("--out", default=None, help="also write the tensors to this .safetensors file")
    fet.add_argument("--parallel", type=int, default=None, help="shards downloaded at once (default: 4, up to 8 with more cores)")
    fet.add_argument("--stall-timeout", type=float, default=10.0, help="seconds without bytes before a source counts as stalled")
    fet.add_argument("--serve-port", type=int, default=None, help="serve held shards to peers on this port while fetching")
    fet.add_argument("--linger", type=float, default=0.0, help="keep serving this many seconds after the fetch")
    fet.add_argument("--no-progress", action="store_true", help="no progress bar")
    fet.set_defaults(func=_fetch)

    ls = cmds.add_parser("ls", help="list versions in a local store or at a source")
    ls.add_argument("--store", default=None, help="local store directory")
    ls.add_argument("--source", default=None, help="source base URL")
    ls.add_argument("--run", default=None, help="run id (with --source: required)")
    ls.set_defaults(func=_ls)


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", required=True, help="store directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0: any free port; printed on start)")
    p.add_argument("--max-concurrent", type=int, default=16, help="shard bodies sent at once; more get 503")
    p.add_argument("--uplink-mibps", type=float, default=None, help="pace all shard bodies to this many MiB/s (emulate a thin uplink)")
    p.add_argument("--super-seed", action="store_true", help="origin: hand each shard out --seed-copies times, then let peers spread it")
    p.add_argument("--seed-copies", type=int, default=1, help="with --super-seed: hand-outs per shard per version (default 1)")


def _load_weights(path: str):
    from shardcast.publish import load_safetensors

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files:
        raise SystemExit(f"no .safetensors under {path}")
    state = {}
    for f in files:
        state.update(load_safetensors(f))
    return state


def _publish(args: argparse.Namespace) -> int:
    from protocol.identity import NodeKey
    from shardcast.publish import PublishOptions, publish
    from shardcast.store import Store

    opts = PublishOptions(shard_size=args.shard_mib << 20, zstd_level=args.zstd_level, keyframe_every=args.keyframe_every, keep_last=args.keep_last)
    signed = publish(Store(args.store), NodeKey.load(args.key), args.run, args.version, _load_weights(args.weights), args.parent, opts)
    m = signed.manifest
    print(json.dumps({"run": m.run_id, "version": m.version, "encoding": m.encoding, "shards": len(m.shards),
                      "raw_bytes": m.total_bytes, "wire_bytes": m.wire_bytes, "manifest_hash": m.manifest_hash(),
                      "publisher": signed.publisher_peer_id}))
    return 0


async def _start_server(args: argparse.Namespace, store):
    from shardcast.server import ShardServer

    rate = None if args.uplink_mibps is None else args.uplink_mibps * 2**20
    from shardcast.seeding import SeedOffer

    seed = SeedOffer(args.seed_copies) if getattr(args, "super_seed", False) else None
    server = ShardServer(store, max_concurrent=args.max_concurrent, uplink_bytes_per_s=rate, seed=seed)
    port = await server.start(args.host, args.port)
    print(f"serving {store.root} on http://{args.host}:{port}", flush=True)
    return server


def _serve(args: argparse.Namespace) -> int:
    from shardcast.store import Store

    async def main() -> None:
        server = await _start_server(args, Store(args.store))
        try:
            await asyncio.Event().wait()
        finally:
            await server.stop()

    return _run_forever(main())


def _relay(args: argparse.Namespace) -> int:
    from shardcast.fetch import Fetcher
    from shardcast.manifest import TrustedPublishers
    from shardcast.relay import mirror
    from shardcast.store import Store

    async def main() -> None:
        store = Store(args.store)
        server = await _start_server(args, store)
        try:
            async with Fetcher(store, args.upstream, TrustedPublishers(args.trust)) as f:
                await mirror(f, args.run, keep_last=args.keep_last, poll_s=args.poll)
        finally:
            await server.stop()

    return _run_forever(main())


def _fetch(args: argparse.Namespace) -> int:
    from shardcast.errors import ShardcastError
    from shardcast.fetch import fetch_version
    from shardcast.manifest import TrustedPublishers
    from shardcast.server import ShardServer
    from shardcast.store import Store

    async def main() -> int:
        store = Store(args.store)
        server = None
        if args.serve_port is not None:
            server = ShardServer(store)
            port = await server.start("127.0.0.1", args.serve_port)
            print(f"serving held shards on http://127.0.0.1:{port}", flush=True)
        try:
            got = await fetch_version(store, args.source, TrustedPublishers(args.trust), args.run, args.version,
                                      stall_timeout=args.stall_timeout, progress=not args.no_progress,
                                      **({} if args.parallel is None else {"parallel": args.parallel}))
            if args.out:
                from safetensors.torch import save_file

                save_file({k: v.clone() for k, v in got.tensors().items()}, args.out)
            print(json.dumps({"run": args.run, "version": got.manifest.version, "raw_bytes": got.manifest.total_bytes,
                              "downloaded_bytes": got.wire_bytes_downloaded, "manifest_hash": got.manifest.manifest_hash()}), flush=True)
            if server is not None and args.linger > 0:
                await asyncio.sleep(args.linger)
            return 0
        except ShardcastError as exc:
            print(f"fetch failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        finally:
            if server is not None:
                await server.stop()

    return asyncio.run(main())


def _ls(args: argparse.Namespace) -> int:
    if args.store:
        from shardcast.store import Store

        store = Store(args.store)
        for run in [args.run] if args.run else store.runs():
            for v in store.versions(run):
                m = store.manifest(run, v).manifest  # type: ignore[union-attr]
                done = "complete" if v in store.complete_versions(run) else f"{len(store.held_shards(run, v))}/{len(m.shards)} shards"
                print(f"{run}\tv{v}\t{m.encoding}\tkeyframe=v{m.keyframe}\t{m.total_bytes / 2**20:.1f} MiB raw\t{m.wire_bytes / 2**20:.1f} MiB wire\t{done}")
        return 0
    if not (args.source and args.run):
        raise SystemExit("give --store DIR, or --source URL with --run RUN")
    import urllib.request

    with urllib.request.urlopen(f"{args.source.rstrip('/')}/shardcast/{args.run}/versions", timeout=10) as r:
        print(json.dumps(json.loads(r.read())))
    return 0


def _run_forever(coro) -> int:
    try:
        asyncio.run(coro)
    except KeyboardInterrupt:
        pass
    return 0
