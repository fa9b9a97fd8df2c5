"""The validator role out of memory while judging: the units it could not recompute get no verdict (the
coordinator offers them again), nobody is struck, the role keeps serving, and once memory is back the same
units pass. `OutOfMemoryReference` is a named fake (this machine has no GPU to run out of memory): the real
`TorchReference`, except that every recomputation raises what a CUDA allocation that does not fit raises."""

from __future__ import annotations

import asyncio

import torch

from node.replay import TorchReference
from node.roles import validator as validator_role
from node.roles.common import fresh_model
from node.roles.resident_policy import ResidentPolicies
from node.roles.validator import ValidatorNode
from protocol.identity import NodeKey
from protocol.messages import RunSpec
from protocol.work import open_unit
from role_rollouts import rolled_out, stored


class OutOfMemoryReference(TorchReference):
    def prefill(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def prefill_mixed_many(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_units_the_validator_runs_out_of_memory_on_are_offered_again_and_pass_once_it_has_room(tmp_path, monkeypatch):
    spec = RunSpec(run_id="oom", coordinator="c", environment="reverse", group_size=2, recipe={"hidden": 64})
    model = fresh_model(spec)
    manifest = "cd" * 32
    key, grants, groups = rolled_out(spec, model, manifest, tmp_path / "inference", 3, task0=200, seed=lambda w: 5 * w + 3)
    units = [open_unit(item, spec.run_id, spec.group_size) for item in stored(key, spec, grants, groups)]
    validator = ValidatorNode(NodeKey.generate(), spec, "", tmp_path / "validator")
    validator.hashes, validator.policies = {0: manifest}, ResidentPolicies(model, 0, bytes.fromhex(manifest))

    monkeypatch.setattr(validator_role, "TorchReference", OutOfMemoryReference)
    assert asyncio.run(validator._judge(units)) == []  # no verdict: offered again, nobody struck
    assert validator.rejected == 0
    monkeypatch.setattr(validator_role, "TorchReference", TorchReference)
    verdicts = asyncio.run(validator._judge(units))
    assert [v.work_id for v in verdicts] == [0, 1, 2] and all(v.valid for v in verdicts), verdicts
