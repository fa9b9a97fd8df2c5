"""`join --role trainer --activation-checkpointing` on one process: the same step, less memory kept."""

from __future__ import annotations

import copy

import torch

from node.model.config import ModelConfig
from node.model.qwen3_moe import CausalLM
from node.rl.batch import TrainBatch
from node.rl.parallel.apply import checkpoint_layer
from node.rl.trainer import Trainer, TrainerConfig


def _batch(vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (4, 13), generator=g)
    mask = torch.zeros(4, 12, dtype=torch.bool)
    mask[:, 4:] = True
    return TrainBatch(ids[:, :-1], ids[:, 1:], mask, -torch.rand(4, 12, generator=g) - 1.0,
                      torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(4, 12).contiguous(), None)


def test_checkpointed_layers_give_the_same_step_as_plain_ones():
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 num_experts=4, num_experts_per_tok=2))
    wrapped = copy.deepcopy(model)
    for layer in wrapped.model.layers:
        checkpoint_layer(layer)
    batch = _batch(64)
    with torch.no_grad():  # on-policy logprobs: no token is masked as off-policy, the policy loss has a gradient
        batch.inference_logprobs = Trainer(copy.deepcopy(model)).logprobs(batch)[0].where(batch.loss_mask, 0.0)
    torch.manual_seed(1)  # the step's row order is random, and the load-balancing loss follows it
    plain_stats = Trainer(model, TrainerConfig(lr=1e-3)).train_step(batch)
    torch.manual_seed(1)
    ckpt_stats = Trainer(wrapped, TrainerConfig(lr=1e-3)).train_step(batch)
    assert plain_stats["masked_share"] < 0.5 and plain_stats["loss"] != 0.0
    assert abs(plain_stats["loss"] - ckpt_stats["loss"]) < 1e-6
    assert abs(plain_stats["grad_norm"] - ckpt_stats["grad_norm"]) < 1e-5 * max(1.0, plain_stats["grad_norm"])
    for (name, a), (_, b) in zip(model.named_parameters(), wrapped.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert plain_stats["grad_norm"] > 0  # the step did something
