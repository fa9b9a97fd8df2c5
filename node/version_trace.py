"""A node's record of when each policy version reached its engine: WORKDIR/versions.jsonl, one line
per version (`version`, `t_announced`, `t_fetch`, `t_fetched`, `t_queued`, Unix seconds).

Installed on an inference node by `join --trace-versions` (`sim` passes it to its inference nodes;
benchmarks.weight_latency reads the files); the role itself only calls its `on_loaded` hooks.
"""

from __future__ import annotations

import json
from pathlib import Path

FILE = "versions.jsonl"


class VersionTrace:
    """An `InferenceNode.on_loaded` hook appending one JSON line per version queued for the engine."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, version: int, times: dict[str, float | None]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"version": version, **times}) + "\n")


def install(node) -> None:
    """Trace `node` (an InferenceNode) into its workdir's versions.jsonl."""
    node.on_loaded.append(VersionTrace(node.workdir / FILE))
