"""KV slots sized from free GPU memory, planned before anything is allocated (node/engine/memory_plan.py)."""

import pytest
import torch

from node.engine.memory_plan import GIB, MAX_SLOTS, MemoryPlanDoesNotFit, plan_slots, slot_bytes
from node.engine.registry import EngineUnavailable
from node.model.config import ModelConfig

# the 8-layer Qwen3-30B-A3B shape's attention and experts
CFG = ModelConfig(vocab_size=151_936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                  num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  num_experts=128, num_experts_per_tok=8, max_position_embeddings=2048)


def test_a_slot_holds_kv_of_every_layer_and_the_engines_per_position_state():
    per = slot_bytes(CFG, 2048, torch.bfloat16)
    kv = 2 * 8 * 4 * 128 * 2 * 2048  # K and V, 8 layers, 4 KV heads x 128, bf16, 2,048 positions
    hidden = 2048 * 2 * 2048  # the proofs' final hidden state per position
    assert per == kv + hidden + (8 + 4 + 8 * 8) * 2048


def test_slots_grow_with_free_memory_up_to_the_largest_bucket():
    per = slot_bytes(CFG, 2048, torch.bfloat16)
    small = plan_slots(CFG, 2048, torch.bfloat16, free_bytes=4 * GIB, share=0.9, wanted=MAX_SLOTS, needed=8)
    big = plan_slots(CFG, 2048, torch.bfloat16, free_bytes=120 * GIB, share=0.9, wanted=MAX_SLOTS, needed=8)
    assert 8 <= small.slots < big.slots == MAX_SLOTS
    assert (small.slots + 1) * per <= small.budget_bytes < (small.slots + 2) * per  # as many as fit, no more
    assert "slots" in small.describe() and "GiB free" in small.describe()
    # a lower share (other roles on the GPU) gives fewer slots
    assert plan_slots(CFG, 2048, torch.bfloat16, 4 * GIB, 0.3, MAX_SLOTS, 8).slots < small.slots


def test_a_plan_that_cannot_hold_one_group_is_one_typed_line_with_the_numbers():
    with pytest.raises(MemoryPlanDoesNotFit) as err:
        plan_slots(CFG, 2048, torch.bfloat16, free_bytes=GIB // 4, share=0.9, wanted=MAX_SLOTS, needed=8)
    msg = str(err.value)
    assert isinstance(err.value, EngineUnavailable)  # the CLI's user errors: one line, exit 2
    assert "needs" in msg and "GiB" in msg and "free" in msg and "\n" not in msg
    with pytest.raises(MemoryPlanDoesNotFit):
        plan_slots(CFG, 2048, torch.bfloat16, free_bytes=100 * GIB, share=1.5, wanted=8, needed=8)
