"""FP8 quantisation and the reference block-scaled GEMM (CPU)."""

import pytest
import torch

from node.fp8.ops import fp8_linear, grouped_linear, scaled_gemm
from node.fp8.quantize import (
    FP8_MAX, UnsupportedTensor, dequantize_act, dequantize_weight, quantize_act, quantize_weight,
)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def test_weight_round_trip_is_within_e4m3_rounding_per_block():
    w = torch.randn(300, 200) * torch.logspace(-3, 1, 200)  # columns of very different magnitude
    q, s = quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    err = (dequantize_weight(q, s) - w).abs()
    # Round-to-nearest e4m3: at most half a step, 2^-4 of the block's largest element (2^-3 ulp).
    block_max = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200] * FP8_MAX
    assert bool((err <= block_max / 16 + 1e-12).all())
    assert rel(dequantize_weight(q, s), w) < 0.05


def test_zero_blocks_get_finite_scales_and_exact_zeros():
    w = torch.zeros(130, 130)
    q, s = quantize_weight(w)
    assert bool(torch.isfinite(s).all()) and bool((s > 0).all())
    assert bool((dequantize_weight(q, s) == 0).all())
    x_q, x_s = quantize_act(torch.zeros(3, 7))
    assert bool(torch.isfinite(x_s).all()) and bool((x_q.float() == 0).all())


def test_block_quantisation_of_a_transpose_is_the_transpose_of_the_quantisation():
    w = torch.randn(256, 384)
    q, s = quantize_weight(w)
    qt, st = quantize_weight(w.t())
    assert torch.equal(q.t().float(), qt.float())
    assert torch.equal(s.t(), st)


def test_activation_scales_are_per_row_per_128_channels():
    x = torch.randn(4, 300)
    x[1] *= 1000  # one loud row must not coarsen the others
    q, s = quantize_act(x)
    assert s.shape == (4, 3)
    assert rel(dequantize_act(q, s)[0], x[0]) < 0.05
    assert rel(dequantize_act(q, s), x) < 0.05


def test_scaled_gemm_matches_float64_within_fp8_range():
    x, w = torch.randn(33, 520), torch.randn(260, 520) * 0.02
    ref = x.double() @ w.double().t()
    out = fp8_linear(x, *quantize_weight(w))
    err = rel(out, ref)
    assert 1e-3 < err < 0.08  # FP8 error is real (not silently bf16) and bounded
    bf16 = rel(x.bfloat16() @ w.bfloat16().t(), ref)
    assert bf16 < err  # the honest high-precision product is closer, as it must be


def test_row_group_gemm_for_weight_gradients_matches_float64():
    a, b = torch.randn(64, 256), torch.randn(96, 256)
    out = scaled_gemm(*quantize_act(a), *quantize_act(b), b_group_n=1, out_dtype=torch.float32)
    assert rel(out, a.double() @ b.double().t()) < 0.08


def test_grouped_linear_equals_per_expert_products():
    counts = torch.tensor([3, 0, 5, 1])
    x, w = torch.randn(9, 160), torch.randn(4, 96, 160) * 0.05
    ref = torch.cat([x[0:3] @ w[0].t(), x[3:8] @ w[2].t(), x[8:9] @ w[3].t()])
    assert rel(grouped_linear(x, counts, w), ref) < 1e-5
    wq, ws = quantize_weight(w)
    assert rel(grouped_linear(x, counts, wq, ws), ref) < 0.08


def test_bad_inputs_raise_a_typed_error():
    with pytest.raises(UnsupportedTensor):
        quantize_weight(torch.zeros(5))
    with pytest.raises(UnsupportedTensor):
        quantize_act(torch.zeros(2, 3, 4))
    with pytest.raises(UnsupportedTensor):
        scaled_gemm(*quantize_act(torch.randn(2, 8)), *quantize_weight(torch.randn(4, 9)))


def test_a_cpu_and_a_gpu_quantise_the_same_weights_to_the_same_bytes():
    """The weights' scales are a true division on both (torch's CUDA kernel would multiply a Python-number
    divisor's reciprocal): a CPU validator holds the e4m3 weights a GPU node serves. Runs where CUDA is."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    w = (torch.randn(1024, 2048) * 0.02).to(torch.bfloat16)
    (qc, sc), (qg, sg) = quantize_weight(w), quantize_weight(w.cuda())
    assert torch.equal(sc, sg.cpu()) and torch.equal(qc.view(torch.uint8), qg.cpu().view(torch.uint8))
    x = torch.randn(64, 2048)
    (qc, sc), (qg, sg) = quantize_act(x), quantize_act(x.cuda())
    assert torch.equal(sc, sg.cpu()) and torch.equal(qc.view(torch.uint8), qg.cpu().view(torch.uint8))
