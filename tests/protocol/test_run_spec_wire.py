"""Why `RunSpec` keeps its own wire defaults for the group shape (docs/architecture.md, "One home per
default"): a spec of the protocol's first schema has no `group_size` or `batch_groups` (a work unit was
one rollout then), and must still decode as that shape: nodes whose defaults differed would hash it as
two runs, and one of them be refused at join. Every spec since carries both fields explicitly, so an
operator's default (`RunConfig`: 64 x 8) travels as a value, never as an absent field."""

from __future__ import annotations

import json

from protocol.messages import RunSpec, decode_message, encode_message

PEER = "12D3KooWGzh1b2VJ2c8Nk5rQb9P9s1p7pY9yq1Qe4sXvTtF3gW8E"

FIRST_SCHEMA = {  # the fields RunSpec had in the protocol's first commit (d7841f2), as it encoded them
    "type": "run_spec", "run_id": "old-run", "coordinator": PEER, "model": "", "environment": "reverse",
    "max_off_policy_steps": 1, "heartbeat_interval_s": 10.0, "dead_after_missed": 3, "lease_ttl_s": 300.0,
    "tasks_per_step": 1 << 20,
}


def test_a_spec_without_the_group_shape_is_one_rollout_per_unit_and_the_shape_always_travels():
    old = decode_message(json.dumps(FIRST_SCHEMA).encode())
    assert isinstance(old, RunSpec) and (old.group_size, old.batch_groups) == (1, 1)
    for shape in ({}, {"group_size": 8, "batch_groups": 64}):
        wire = json.loads(encode_message(RunSpec(run_id="r", coordinator=PEER, **shape)))
        assert wire["group_size"] == shape.get("group_size", 1) and wire["batch_groups"] == shape.get("batch_groups", 1)
