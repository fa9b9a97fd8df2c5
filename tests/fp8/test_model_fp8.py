"""The FP8 model path, router replay, FP8 training and the fixed-shape decoder, on a tiny model (CPU)."""

import copy

import torch
import torch.nn.functional as F

from benchmarks.fixed_decode import FixedBatchDecoder
from node.engine.fp8.model import FP8GroupedExperts, FP8Linear, quantize_model_fp8
from node.model.config import ModelConfig
from node.model.qwen3_moe import CausalLM
from node.rl.fp8 import FP8Matmul, FP8TrainGroupedExperts, FP8TrainLinear, apply_fp8_training

CFG = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
                  num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, head_dim=32)


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    m = CausalLM(CFG)
    with torch.no_grad():
        m.lm_head.weight.mul_(10)  # peaked distributions, so a KL is a meaningful check
    return m.eval()


@torch.no_grad()
def test_fp8_model_swaps_projections_and_experts_and_stays_close_to_full_precision():
    ref_model = model()
    fp8 = quantize_model_fp8(copy.deepcopy(ref_model))
    layer = fp8.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, FP8Linear)
    assert isinstance(layer.mlp.experts, FP8GroupedExperts)
    assert type(layer.mlp.gate) is torch.nn.Linear and type(fp8.lm_head) is torch.nn.Linear
    ids = torch.randint(0, 64, (2, 16))
    ref, out = ref_model(ids), fp8(ids)
    assert 0 < kl(ref.logits, out.logits) < 0.05


@torch.no_grad()
def test_loading_a_new_version_quantises_on_arrival_without_rebuilding():
    fp8 = quantize_model_fp8(model(0))
    ids = torch.randint(0, 64, (1, 10))
    before = fp8(ids).logits
    new_version = model(1)
    result = fp8.load_state_dict(new_version.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    after = fp8(ids).logits
    expected = quantize_model_fp8(model(1))(ids).logits
    assert not torch.allclose(before, after)
    assert torch.equal(after, expected)
    # Same names out as in: a quantised model can publish or checkpoint as usual.
    assert set(fp8.state_dict()) == set(new_version.state_dict())


@torch.no_grad()
def test_router_replay_makes_the_trainer_use_the_engines_experts():
    engine, trainer = quantize_model_fp8(model()), model()
    ids = torch.randint(0, 64, (2, 16))
    eng = engine(ids)
    free = trainer(ids)
    replayed = trainer(ids, routed_experts=eng.routed_experts)
    assert torch.equal(replayed.routed_experts, eng.routed_experts)
    assert kl(eng.logits, replayed.logits) <= kl(eng.logits, free.logits) + 1e-6


def test_fp8_matmul_gradients_match_float64_within_fp8_range():
    x = torch.randn(40, 256, dtype=torch.float64).float().requires_grad_()
    w = (torch.randn(136, 256) * 0.05).requires_grad_()
    dy = torch.randn(40, 136)
    gx, gw = torch.autograd.grad(FP8Matmul.apply(x, w), (x, w), dy)
    rx, rw = dy.double() @ w.detach().double(), dy.double().t() @ x.detach().double()
    assert float((gx - rx).norm() / rx.norm()) < 0.08
    assert float((gw - rw).norm() / rw.norm()) < 0.08
    assert gw.dtype == w.dtype


def test_fp8_training_keeps_parameters_and_learns():
    torch.manual_seed(0)
    m = apply_fp8_training(CausalLM(CFG))
    assert isinstance(m.model.layers[0].self_attn.o_proj, FP8TrainLinear)
    assert isinstance(m.model.layers[1].mlp.experts, FP8TrainGroupedExperts)
    assert all(p.dtype == torch.float32 for p in m.parameters())  # master weights untouched
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    x = torch.arange(32).repeat(2, 1) % 16  # a pattern a tiny model learns in a few steps
    losses = []
    for _ in range(12):
        loss = F.cross_entropy(m(x).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    experts = m.model.layers[0].mlp.experts
    assert experts.gate_up_proj.grad is None  # zero_grad ran; a fresh step must produce one
    F.cross_entropy(m(x).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
    assert experts.gate_up_proj.grad is not None and bool(experts.gate_up_proj.grad.abs().sum() > 0)


@torch.no_grad()
def test_fixed_shape_decoder_matches_full_recompute():
    m = model()
    prompt = torch.randint(0, 64, (3, 5))
    dec = FixedBatchDecoder(m, batch=3, max_len=12, use_graph=False)
    got = dec.greedy(prompt, 6)
    seq = prompt
    for _ in range(6):
        seq = torch.cat([seq, m(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, seq[:, 5:])
