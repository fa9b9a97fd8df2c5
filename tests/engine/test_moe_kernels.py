"""The engine's MoE combine kernel against the model's combine (torch ops): on a GPU, and on the CPU in
Triton's interpreter where Triton is installed (CI has none: skipped there)."""

import pytest
import torch
from triton_on import triton_on

from node.model.moe import FUSED_COMBINE, MoEBlock


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_fused_kernels_sums_what_the_models_combine_sums(device, monkeypatch):
    """Each token's k expert rows times the router's weights, each product rounded to bf16, summed in float32: on a
    GPU within one bf16 step of the model's gather-and-sum wherever they differ (the order of the float32 sum), in
    few places, and the engine's forward takes it (`fused_kernels`), the trainer's autograd does not."""
    triton_on(device, monkeypatch)
    from node.engine.forward import fused_kernels
    from node.engine.moe_kernels import moe_combine

    torch.manual_seed(0)
    block = MoEBlock(256, 128, 16, 4, True)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
    block = block.to(device=device, dtype=torch.bfloat16)
    x = torch.randn(300, 256, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        want, routing = block(x)
        x_sorted, counts, order = block.dispatch(x, routing)
        y_sorted = block.experts(x_sorted, counts)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=device)
        got = moe_combine(y_sorted, inverse, routing.weights.reshape(-1), block.top_k)
    assert got.shape == want.shape and got.dtype == torch.bfloat16 and want.abs().max() > 0.05
    diff = (got.float() - want.float()).abs()
    if device == "cpu":  # the interpreter's casts to bf16 truncate (a GPU's round): its indexing is what is checked
        assert float(diff.max()) <= 2**-5 * float(want.abs().max())
    else:
        assert bool((diff <= want.float().abs() * 2**-7 + 1e-6).all()), float(diff.max())
        assert (diff > 0).float().mean() <= 0.01
        with torch.no_grad(), fused_kernels(True):
            assert FUSED_COMBINE.get() is moe_combine
            fused, _ = block(x)
        assert torch.equal(fused, got) and FUSED_COMBINE.get() is None
        with fused_kernels(True):  # autograd on: the model's ops, whose backward exists
            trained, _ = block(x)
        assert trained.requires_grad and torch.equal(trained.detach(), want)
