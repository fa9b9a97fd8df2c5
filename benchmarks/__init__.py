"""Benchmarks: `python -m benchmarks.NAME`, each ending with one JSON line of figures."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: Path | None) -> int:
    """A benchmark's ending: the result written to `out` (indented) when given, and one JSON line on stdout."""
    if out:
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0
