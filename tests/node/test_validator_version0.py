"""A validator whose first version is a later one still checks a version 0 it fetches afterwards against
the run's pinned weights hash (`ValidatorNode._hold`): the published version 0 joins the resident model,
weights of another model are refused with the typed `WeightsHashMismatch`."""

from __future__ import annotations

import pytest
import torch

from node.model.checkpoint import state_dict_to_hf
from node.model.errors import WeightsHashMismatch
from node.model.spec import weights_hash
from node.roles.common import fresh_model
from node.roles.validator import ValidatorNode
from protocol.identity import NodeKey
from protocol.messages import RunSpec


def test_a_version_0_fetched_after_a_later_version_is_checked_against_the_pin(tmp_path):
    spec = RunSpec(run_id="late-v0", coordinator=NodeKey.generate().peer_id, environment="reverse")
    v0 = fresh_model(spec)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"weights_hash": weights_hash(v0)})})
    state0 = {k: t.clone() for k, t in state_dict_to_hf(v0).items()}
    state1 = {k: t + 0.01 for k, t in state0.items()}
    node = ValidatorNode(NodeKey.generate(), spec, "", tmp_path)
    node._hold(1, state1, b"\1" * 32)
    with pytest.raises(WeightsHashMismatch):
        node._hold(0, state1, b"\0" * 32)  # version 1's weights offered as version 0
    assert sorted(node.policies) == [1]
    node._hold(0, state0, b"\0" * 32)
    model, manifest_hash = node.policies[0]
    assert manifest_hash == b"\0" * 32
    assert all(torch.equal(model.state_dict()[k], t) for k, t in v0.state_dict().items())
