"""Policy-weight distribution: publish (shard, zstd, XOR-delta, sign), serve (origin, relay,
peer), fetch (many sources at once, every shard verified). Start at docs/shardcast.md; the
walk is publish.py -> store.py -> server.py -> fetch.py (sources.py picks, codec.py decodes)."""

DEFAULT_PORT = 8470
"""The HTTP port a shardcast server (a trainer's origin, a relay) listens on unless told otherwise."""
