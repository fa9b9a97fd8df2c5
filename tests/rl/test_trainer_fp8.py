"""The recipe's `train_fp8`: the trainer's projections and experts compute in block-scaled FP8
(node/rl/fp8.py), the parameters and their names stay, and a step moves the weights as the
high-precision step does up to FP8 rounding."""

import copy

import pytest
import torch

from node.recipe import InvalidRecipe, Recipe
from node.rl.fp8 import FP8TrainGroupedExperts, FP8TrainLinear
from node.rl.trainer import Trainer, TrainerConfig
from node.model.qwen3_moe import CausalLM
from rl.test_micro_batches import CFG, long_tailed_batch  # the same long-tailed batch (tests/ is on the path)


def test_the_recipe_turns_fp8_training_on_and_the_trainer_swaps_its_layers_in_place():
    assert TrainerConfig.from_recipe(Recipe.parse({"train_fp8": "1"})).fp8 is True
    assert TrainerConfig.from_recipe(Recipe.parse({})).fp8 is False
    with pytest.raises(InvalidRecipe, match="train_fp8"):
        Recipe.parse({"train_fp8": [1]})
    torch.manual_seed(0)
    model = CausalLM(CFG)
    names = {n: p.data_ptr() for n, p in model.named_parameters()}
    trainer = Trainer(model, TrainerConfig(fp8=True, router_replay=False))
    kinds = {type(m) for m in trainer.model.modules()}
    assert FP8TrainLinear in kinds and FP8TrainGroupedExperts in kinds
    assert {n: p.data_ptr() for n, p in trainer.model.named_parameters()} == names  # the same parameters
    assert type(trainer.model.lm_head) is torch.nn.Linear  # the LM head stays high precision


def test_an_fp8_step_moves_the_weights_as_the_high_precision_step_does():
    cfg = CFG.model_copy(update={"router_aux_loss_coef": 0.0})
    torch.manual_seed(0)
    model = CausalLM(cfg)
    batch = long_tailed_batch()
    with torch.no_grad():  # sampled by this very policy: the trust region admits every token
        own, _ = Trainer(copy.deepcopy(model), TrainerConfig(router_replay=False)).logprobs(batch)
    batch.inference_logprobs = torch.where(batch.loss_mask, own, batch.inference_logprobs)
    moved = {}
    for fp8 in (False, True):
        trainer = Trainer(copy.deepcopy(model), TrainerConfig(lr=1e-2, updates_per_batch=1, minibatches=1,
                                                              router_replay=False, fp8=fp8))
        torch.manual_seed(1)
        metrics = trainer.train_step(batch)
        assert metrics["masked_share"] < 0.5
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float))
        moved[fp8] = {n: p.detach() - model.state_dict()[n] for n, p in trainer.model.named_parameters()}
    # the update's direction is the high-precision one up to FP8 rounding: cosine over the decoder layers
    names = [n for n in moved[False] if ".layers." in n and moved[False][n].norm() > 0]
    a = torch.cat([moved[False][n].flatten() for n in names])
    b = torch.cat([moved[True][n].flatten() for n in names])
    assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) > 0.9  # 0.953 seen
    assert not torch.equal(a, b)  # and it did run another path
