"""Makes `protocol_testnet` (real hosts, coordinator and members for tests) importable under
pytest's importlib mode."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
