"""Where a member gets the run spec: the file the operator handed out (`--spec`), checked against
the bootstrap coordinator, or the coordinator itself over `SPEC_PROTOCOL`."""

from __future__ import annotations

import asyncio
from pathlib import Path

from node.launch_guard import LaunchError
from protocol.identity import NodeKey
from protocol.messages import RunSpec
from protocol.transport import PeerHost

SPEC_PROTOCOL = "/primerl/spec/1"
"""Where a coordinator hands out its run spec; the stream is authenticated (Noise) to the peer id
in the bootstrap multiaddr, and the spec must name that peer as its coordinator."""


def read_spec(path: Path, bootstrap: str) -> RunSpec:
    """The spec file the operator handed out, checked to be a spec of the coordinator at `bootstrap`."""
    try:
        spec = RunSpec.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise LaunchError(f"--spec {path}: {exc.strerror or exc} (the operator's STATE/spec.json; or leave --spec "
                          "out to ask the coordinator for it)") from None
    except ValueError as exc:
        raise LaunchError(f"--spec {path} is not a run spec: {str(exc).splitlines()[0]}") from None
    coordinator = bootstrap.rsplit("/p2p/", 1)[-1]
    if "/p2p/" in bootstrap and spec.coordinator != coordinator:
        raise LaunchError(f"--spec {path} is the spec of coordinator {spec.coordinator}, but --bootstrap names "
                          f"{coordinator} (an old spec.json, or another run's)")
    return spec


async def fetch_spec(bootstrap: str, timeout: float = 30.0) -> RunSpec:
    """The run spec from the coordinator at `bootstrap` (retried while it starts up)."""
    coordinator = bootstrap.rsplit("/p2p/", 1)[-1]
    host = PeerHost(NodeKey.generate())
    await host.start()
    try:
        end = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                await host.connect(bootstrap, timeout=5)
                spec = RunSpec.model_validate_json(await host.request(coordinator, SPEC_PROTOCOL, b"{}", timeout=10))
                break
            except Exception as exc:
                if asyncio.get_running_loop().time() > end:
                    raise SystemExit(f"no run spec from {bootstrap}: {exc}")
                await asyncio.sleep(1.0)
    finally:
        await host.stop()
    if spec.coordinator != coordinator:
        raise SystemExit(f"the spec from {bootstrap} names another coordinator ({spec.coordinator})")
    return spec
