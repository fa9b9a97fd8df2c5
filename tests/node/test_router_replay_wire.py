"""Routed experts in a signed submission: optional, omitted when absent (old bytes unchanged), bounded,
and what the inference role sends decodes to the engine's routes."""

from __future__ import annotations

import pytest
import torch

from node.engine import Engine, Request, SamplingParams
from node.envs.base import Task
from node.envs.rollout import Rollout
from node.model import CausalLM, ModelConfig
from node.model.routing import RouteShape, decode_routes
from protocol.errors import MalformedMessage
from protocol.messages import MAX_ROUTED_EXPERTS_BYTES, RolloutSubmission, decode_message, encode_message

LEGACY = (b'{"v":1,"type":"rollout_submission","work_id":1,"version_runs":[[0,2]],"token_ids":[3,4],'
          b'"logprobs":[-1.0,-2.0],"reward":0.0,"proof":"","finish_reason":"eos","sampled":null}')
"""A submission as encoded before `routed_experts` existed."""


def test_a_submission_without_routes_keeps_its_bytes_and_one_with_routes_round_trips():
    sub = RolloutSubmission(work_id=1, version_runs=[(0, 2)], token_ids=[3, 4], logprobs=[-1.0, -2.0], reward=0.0,
                            finish_reason="eos")
    assert encode_message(sub) == LEGACY and decode_message(LEGACY) == sub
    routed = sub.model_copy(update={"routed_experts": bytes(range(12))})
    assert b'"routed_experts":"AAECAwQFBgcICQoL"' in encode_message(routed)
    assert decode_message(encode_message(routed)) == routed


def test_route_bytes_beyond_the_bound_are_refused():
    too_big = LEGACY[:-1] + b',"routed_experts":"' + b"A" * (4 * (MAX_ROUTED_EXPERTS_BYTES // 3 + 1)) + b'"}'
    with pytest.raises(MalformedMessage):
        decode_message(too_big)


def test_the_inference_role_sends_the_engine_routes_of_every_position():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=48, hidden_size=32, moe_intermediate_size=32, head_dim=8, num_experts=8,
                      num_experts_per_tok=2)
    engine = Engine(CausalLM(cfg).eval(), max_batch=4, eos_id=-1, capture_experts=True)
    c = engine.generate([Request("r", [3, 4, 5], SamplingParams(max_new_tokens=6, seed=1))])[0]
    r = Rollout("r", Task("t", "", ""), c.prompt_ids, c.token_ids, [True] * 6, c.logprobs, c.versions, turns=[c],
                finish_reason=c.finish_reason)
    shape = RouteShape.of(cfg)
    sub = r.to_submission(1, b"", routes=shape)
    assert len(sub.routed_experts) == (3 + 6 - 1) * 2 * 2
    assert torch.equal(decode_routes(sub.routed_experts, 3 + 6 - 1, shape), c.routed_experts)
    assert r.to_submission(1, b"").routed_experts is None  # a run without router replay sends none
