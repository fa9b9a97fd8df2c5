import copy
import dataclasses

import torch

from node.engine import Engine, Request, SamplingParams
from node.envs.base import Task
from node.envs.rollout import Rollout
from node.model import CausalLM, ModelConfig
from node.rl.batch import build_batch
from node.rl.trainer import Trainer, TrainerConfig


def test_router_replay_matches_engine_logprobs_after_the_router_moved(tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=48, hidden_size=32, moe_intermediate_size=32, head_dim=8, num_experts=8, num_experts_per_tok=2)
    model = CausalLM(cfg).eval()
    engine = Engine(copy.deepcopy(model), max_batch=8, eos_id=-1, capture_experts=True)
    comps = engine.generate([Request(str(i), [3, 4 + i, 5], SamplingParams(max_new_tokens=10, seed=i)) for i in range(8)])
    rollouts = [Rollout(c.request_id, Task("t", "", ""), c.prompt_ids, c.token_ids, [True] * len(c.token_ids),
                        c.logprobs, c.versions, routed_experts=c.routed_experts) for c in comps]
    batch = build_batch(rollouts, [0.0] * len(rollouts))
    # the trainer's routers move a little (as after optimizer steps): some tokens flip experts
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.add_(torch.randn_like(layer.mlp.gate.weight) * 0.1)
    trainer = Trainer(model, TrainerConfig(router_replay=True))
    with torch.no_grad():
        replayed, _ = trainer.logprobs(batch, replay=True)
        used = model(batch.input_ids, routed_experts=batch.routed_experts).routed_experts
        moved = model(batch.input_ids).routed_experts
    assert torch.equal(used, batch.routed_experts) and not torch.equal(moved, batch.routed_experts)
    # the trainer role's batches hold routes as compact as the wire (uint8 here): the same replay, widened in the model
    narrow = build_batch([dataclasses.replace(r, routed_experts=r.routed_experts.to(torch.uint8)) for r in rollouts],
                         [0.0] * len(rollouts))
    assert narrow.routed_experts.dtype == torch.uint8
    with torch.no_grad():
        assert torch.equal(trainer.logprobs(narrow, replay=True)[0], replayed)
    with torch.no_grad():
        free, _ = trainer.logprobs(batch, replay=False)
    engine_lp = batch.inference_logprobs
    mask = batch.loss_mask
    err_replay = (replayed - engine_lp)[mask].abs().max()
    err_free = (free - engine_lp)[mask].abs().max()
    assert err_free > 1e-2  # without replay the moved router picks other experts
    # with replay the same experts compute each token; only their (renormalised) weights moved
    assert err_replay < err_free / 3
    # and with the router unchanged, replay reproduces the engine exactly
    trainer2 = Trainer(copy.deepcopy(engine.model), TrainerConfig(router_replay=True))
    with torch.no_grad():
        exact, _ = trainer2.logprobs(batch)
    assert (exact - engine_lp)[mask].abs().max() <= 1e-4


def test_trainer_checkpoint_resumes_bit_exact(tmp_path):
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=48, hidden_size=32, moe_intermediate_size=32, head_dim=8)
    trainer = Trainer(CausalLM(cfg), TrainerConfig(updates_per_batch=1, minibatches=1))
    ids = [3, 4, 5, 6, 7, 8]
    r = Rollout("e", Task("t", "", ""), ids[:3], ids[3:], [True] * 3, [-3.0] * 3, [0] * 3)
    batch = build_batch([r], [1.0])
    trainer.train_step(batch)
    trainer.save(tmp_path / "ckpt")
    resumed = Trainer.load(tmp_path / "ckpt")
    torch.manual_seed(2)
    trainer.train_step(batch)
    torch.manual_seed(2)
    resumed.train_step(batch)
    assert resumed.step == trainer.step == 2
    for (n, a), (_, b) in zip(trainer.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-7), n
