"""Shared pieces of the shardcast tests: a publisher key, small bf16 state dicts, a real
origin server over a real store, and a real (hostile) aiohttp source that misbehaves on demand."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from aiohttp import web

from protocol.identity import NodeKey
from shardcast.manifest import TrustedPublishers
from shardcast.publish import PublishOptions, publish
from shardcast.server import ShardServer
from shardcast.store import Store

SHARD = 64 << 10  # small shards so a ~1 MiB model has many of them


def make_state(seed: int = 0, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": (torch.randn(256, 512, generator=g) * 0.02 * scale).bfloat16(),
        "model.layers.0.mlp.gate_proj.weight": (torch.randn(300, 512, generator=g) * 0.02).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.ones(512),
        "model.norm.weight": torch.ones(511, dtype=torch.float16),
        "step": torch.tensor([seed], dtype=torch.int64),
    }


def rl_step(state: dict[str, torch.Tensor], seed: int, lr: float = 1e-3) -> dict[str, torch.Tensor]:
    """A small update to every float weight, like one optimizer step."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for k, v in state.items():
        if v.is_floating_point():
            out[k] = (v.float() + lr * torch.randn(v.shape, generator=g) * v.float().abs().mean()).to(v.dtype)
        else:
            out[k] = v + 1
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8) if a[k].numel() else a[k], b[k].view(torch.uint8) if b[k].numel() else b[k]), k


@pytest.fixture
def key() -> NodeKey:
    return NodeKey.from_seed(b"\x01" * 32)


@pytest.fixture
def trusted(key: NodeKey) -> TrustedPublishers:
    return TrustedPublishers([key.peer_id])


@pytest.fixture
def origin_store(tmp_path: Path, key: NodeKey) -> Store:
    store = Store(tmp_path / "origin")
    publish(store, key, "run", 0, make_state(0), options=PublishOptions(shard_size=SHARD))
    return store


class HostileSource:
    """A real HTTP source that serves a store's files but misbehaves on shard requests:
    mode 'corrupt' flips a byte, 'truncate' sends half and cuts the connection, 'short' sends
    half with a matching Content-Length, 'stall' sends headers then nothing, 'manifest' serves
    the manifest with a tensor renamed (signature left as it was), 'long' sends the shard plus 64
    bytes, 'odd' corrupts odd-numbered shards only, 'honest' behaves."""

    def __init__(self, store: Store, mode: str):
        self.store, self.mode, self.shard_requests = store, mode, 0
        self.app = web.Application()
        self.app.add_routes([
            web.get("/shardcast/{run}/versions", self._versions),
            web.get("/shardcast/{run}/{version}/manifest", self._manifest),
            web.get("/shardcast/{run}/{version}/have", self._have),
            web.get("/shardcast/{run}/{version}/shard/{index}", self._shard),
        ])
        self.runner: web.AppRunner | None = None
        self.url = ""
        self._released = asyncio.Event()

    async def start(self) -> str:
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self.url

    async def stop(self) -> None:
        self._released.set()
        if self.runner:
            await self.runner.cleanup()

    async def _versions(self, r: web.Request) -> web.Response:
        run = r.match_info["run"]
        return web.json_response({"versions": self.store.versions(run), "complete": self.store.complete_versions(run)})

    async def _manifest(self, r: web.Request) -> web.Response:
        body = self.store.manifest_path(r.match_info["run"], int(r.match_info["version"])).read_bytes()
        if self.mode == "manifest":
            body = body.replace(b'"name":"step"', b'"name":"stEp"')
        return web.Response(body=body, content_type="application/json")

    async def _have(self, r: web.Request) -> web.Response:
        return web.json_response({"shards": self.store.held_shards(r.match_info["run"], int(r.match_info["version"]))})

    async def _shard(self, r: web.Request) -> web.StreamResponse:
        self.shard_requests += 1
        data = self.store.read_shard(r.match_info["run"], int(r.match_info["version"]), int(r.match_info["index"]))
        if self.mode == "corrupt" or (self.mode == "odd" and int(r.match_info["index"]) % 2):
            data = data[:100] + bytes([data[100] ^ 1]) + data[101:]
        if self.mode == "long":
            data = data + b"\0" * 64
        if self.mode == "short":
            return web.Response(body=data[: len(data) // 2])
        resp = web.StreamResponse()
        resp.content_length = len(data)
        await resp.prepare(r)
        if self.mode == "stall":
            try:
                await asyncio.wait_for(self._released.wait(), 30)
            except asyncio.TimeoutError:
                pass
        if self.mode == "truncate":
            await resp.write(data[: len(data) // 2])
            r.transport.close()  # type: ignore[union-attr]
            return resp
        await resp.write(data)
        await resp.write_eof()
        return resp


async def serve(store: Store, **kw) -> tuple[ShardServer, str]:
    server = ShardServer(store, **kw)
    port = await server.start("127.0.0.1", 0)
    return server, f"http://127.0.0.1:{port}"


class Helpers:
    SHARD = SHARD
    make_state = staticmethod(make_state)
    rl_step = staticmethod(rl_step)
    assert_same = staticmethod(assert_same)
    HostileSource = HostileSource
    serve = staticmethod(serve)


@pytest.fixture
def sc() -> type[Helpers]:
    """The helpers above (pytest's importlib mode cannot import conftest as a module)."""
    return Helpers
