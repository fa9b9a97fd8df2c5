"""The trainer role says when its master weights are bf16/fp16 (updates below half a step are lost), and
is silent with an fp32 master."""

import logging

import torch

from node.roles.trainer import note_master_precision


def test_a_bf16_master_is_named_with_the_learning_rate_and_an_fp32_one_is_not(caplog):
    with caplog.at_level(logging.WARNING, logger="node.roles.trainer"):
        assert note_master_precision(torch.nn.Linear(4, 4), 1e-6) is None
        assert not caplog.records
        msg = note_master_precision(torch.nn.Linear(4, 4).to(torch.bfloat16), 1e-6)
    assert msg is not None and "bfloat16" in msg and "lr 1e-06" in msg
    assert [r.getMessage() for r in caplog.records] == [msg]
    frozen = torch.nn.Linear(4, 4).to(torch.bfloat16).requires_grad_(False)  # nothing trained: nothing lost
    assert note_master_precision(frozen, 1e-6) is None
