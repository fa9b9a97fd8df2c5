"""Makes `protocol_testnet` (real hosts, coordinator and members; tests/protocol) importable here."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "protocol"))
