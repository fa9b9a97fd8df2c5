import torch

from node.rl.advantages import group_advantages
from node.rl.loss import LossConfig, policy_loss


def grads(trainer_lp, inference_lp, adv, mask=None, cfg=LossConfig()):
    lp = torch.tensor([trainer_lp], requires_grad=True)
    mask = torch.ones_like(lp, dtype=torch.bool) if mask is None else torch.tensor([mask])
    out = policy_loss(lp, torch.tensor([inference_lp]), torch.tensor([adv]), mask, cfg)
    out.loss.backward()
    return lp.grad[0], out


def test_positive_advantage_raises_and_negative_lowers_the_token_logprob():
    g, _ = grads([-1.0, -1.0], [-1.0, -1.0], [1.0, -1.0])
    assert g[0] < 0 < g[1]  # gradient descent: -g raises token 0, lowers token 1


def test_tokens_beyond_the_trust_region_in_their_push_direction_are_masked_not_clipped():
    up, down = torch.log(torch.tensor(1.5)).item(), torch.log(torch.tensor(0.5)).item()
    # ratio 1.5 with A>0 (pushed up already too far): masked; ratio 1.5 with A<0: still learns
    g, out = grads([up - 1, up - 1, down - 1, down - 1], [-1.0] * 4, [1.0, -1.0, 1.0, -1.0])
    assert g[0] == 0 and g[1] > 0
    assert g[2] < 0 and g[3] == 0
    assert out.masked_share == 0.5


def test_hard_bounds_drop_tokens_whatever_their_advantage():
    g, out = grads([-1.0 + 3.0, -1.0 - 3.0, -1.0], [-1.0] * 3, [-1.0, 1.0, 1.0])  # ratios e^3, e^-3, 1
    assert g[0] == 0 and g[1] == 0 and g[2] < 0
    assert abs(out.masked_share - 2 / 3) < 1e-6


def test_loss_ignores_tool_and_padding_tokens_and_reports_mismatch():
    g, out = grads([-1.0, -2.0], [-1.1, -2.0], [1.0, 1.0], mask=[True, False])
    assert g[1] == 0 and g[0] < 0
    r = torch.exp(torch.tensor(0.1))
    assert abs(out.mismatch_kl - float(r - 1 - 0.1)) < 1e-6  # k3 on the one loss token
    _, same = grads([-1.0], [-1.0], [1.0])
    assert same.mismatch_kl == 0.0


def test_group_advantages_are_relative_and_zero_for_uniform_groups():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.5, 0.5], [0.3, 0.3, 0.3, 0.3]]))
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, 0.0, 0.0]))
    assert torch.equal(adv[1], torch.zeros(4))


def test_token_logprobs_in_chunks_equal_the_whole_batch_form_in_value_and_gradient(monkeypatch):
    import node.rl.loss as loss_mod

    torch.manual_seed(0)
    logits = torch.randn(5, 7, 33, dtype=torch.float64).float().requires_grad_()
    targets = torch.randint(0, 33, (5, 7))
    whole = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (g_whole,) = torch.autograd.grad(whole.sum(), logits)
    monkeypatch.setattr(loss_mod, "LOGPROB_CHUNK_BYTES", 4 * 7 * 33 * 2)  # two rows a chunk: three chunks
    chunked = loss_mod.token_logprobs(logits, targets, 0.7)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), logits)
    assert chunked.shape == (5, 7)
    assert torch.allclose(chunked, whole, atol=1e-5) and torch.allclose(g_chunked, g_whole, atol=1e-5)
    with torch.no_grad():
        assert torch.allclose(loss_mod.token_logprobs(logits, targets, 0.7), whole, atol=1e-5)
