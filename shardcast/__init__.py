"""Policy-weight distribution: publish (shard, zstd, XOR-delta, sign), serve (origin, relay,
peer), fetch (many sources at once, every shard verified). Start at docs/shardcast.md; the
walk is publish.py -> store.py -> server.py -> fetch.py (sources.py picks, codec.py decodes)."""
