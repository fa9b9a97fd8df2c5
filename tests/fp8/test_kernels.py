"""Triton kernels against float64: on CUDA (marked gpu), and through Triton's CPU interpreter when
Triton is installed here (the kernels' indexing and masking, with inputs quantised by torch)."""

import os

import pytest
import torch
from triton_on import triton_on

from node.fp8.quantize import dequantize_act, dequantize_weight, quantize_act, quantize_weight

def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def _same_quantisation(q: torch.Tensor, s: torch.Tensor, rq: torch.Tensor, rs: torch.Tensor, case: object) -> None:
    """The kernel's activation quantisation against the reference: the same scales (both divide with IEEE
    rounding) and, on a GPU, the same e4m3 bytes (the interpreter's cast to e4m3 rounds otherwise than a GPU's:
    there the scales alone are compared)."""
    assert torch.equal(s, rs), (case, (s - rs).abs().max())
    if q.device.type != "cpu":
        codes = q.view(torch.uint8).int() - rq.view(torch.uint8).int()
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), (case, int((codes != 0).sum()))


def _cases(device: str):
    # Against the exact product of the quantised inputs: Hopper's FP8 tensor cores keep fewer
    # accumulator bits than fp32 within each 128-wide block (measured 1.2e-4 on an H200), hence 1e-3.
    from node.fp8.kernels import gemm_triton, grouped_gemm_triton, quant_act_rows, quantize_act_triton

    # activation quantisation at each rows-a-program setting and a ragged last tile (before the kernel divided with
    # IEEE rounding, on an H100: scales one ulp apart, 1 of 1,500 e4m3 values of a bf16 input one code off)
    for m in (5, 70, 1100):
        a = (torch.randn(m, 300, device=device) * torch.rand(m, 1, device=device) * 8).to(torch.bfloat16)
        _same_quantisation(*quantize_act_triton(a), *quantize_act(a), m)
    assert [quant_act_rows(m) for m in (5, 70, 1100)] == [1, 8, 32]
    x, w = torch.randn(37, 300, device=device), torch.randn(150, 300, device=device) * 0.05
    xq, xs = quantize_act(x)
    wq, ws = quantize_weight(w)
    exact = dequantize_act(xq, xs).double() @ dequantize_weight(wq, ws).double().t()
    assert rel(gemm_triton(xq, wq, xs, ws, out_dtype=torch.float32), exact) < 1e-3
    assert rel(gemm_triton(xq, wq, xs, ws, out_dtype=torch.float32), x.double() @ w.double().t()) < 0.08
    counts = torch.tensor([3, 0, 17, 1, 9], device=device)
    xe, we = torch.randn(30, 300, device=device), torch.randn(5, 150, 300, device=device) * 0.05
    xq, xs = quantize_act(xe)
    wq, ws = quantize_weight(we)
    out = grouped_gemm_triton(xq, wq, counts, xs, ws, out_dtype=torch.float32)
    xd, wd = dequantize_act(xq, xs).double(), dequantize_weight(wq, ws).double()
    bounds = [0, 3, 3, 20, 21, 30]
    ref = torch.cat([xd[bounds[e]:bounds[e + 1]] @ wd[e].t() for e in range(5)])
    assert rel(out, ref) < 1e-3
    plain = grouped_gemm_triton(xe, we, counts, out_dtype=torch.float32)  # unscaled path, fp32 here
    ref = torch.cat([xe[bounds[e]:bounds[e + 1]].double() @ we[e].double().t() for e in range(5)])
    assert rel(plain, ref) < 5e-3  # tf32 on CUDA
    # each program finds its expert's rows from the counts: experts of no rows first, between and last, one of
    # several tiles, seven experts (not a power of two), each tile height (on an H100 the float32 outputs of the
    # three tilings differ in low bits: other MMA shapes accumulate each 128-wide block otherwise)
    counts = torch.tensor([0, 5, 0, 40, 2, 0, 0], device=device)
    xe, we = torch.randn(47, 256, device=device), torch.randn(7, 128, 256, device=device) * 0.05
    xq, xs = quantize_act(xe)
    wq, ws = quantize_weight(we)
    xd, wd, bounds = dequantize_act(xq, xs).double(), dequantize_weight(wq, ws).double(), [0, 0, 5, 5, 45, 47, 47, 47]
    ref = torch.cat([xd[bounds[e]:bounds[e + 1]] @ wd[e].t() for e in range(7)])
    outs = [grouped_gemm_triton(xq, wq, counts, xs, ws, out_dtype=torch.float32, config=(bm, bn, 4, 3))
            for bm, bn in ((16, 32), (32, 64), (64, 128))]
    assert all(rel(o, ref) < 1e-3 for o in outs), [rel(o, ref) for o in outs]


def test_kernels_compute_the_reference_function_in_the_triton_interpreter(monkeypatch):
    triton_on("cpu", monkeypatch)
    _cases("cpu")
    from node.fp8 import kernels

    # decode-sized GEMMs on a GPU of many SMs take narrow tiles: the same function with them
    assert kernels._gemm_tiles(128, 512, 132)[:2] == (128, 32) and kernels._gemm_tiles(256, 8192, 132)[:2] == (128, 64)
    assert kernels._gemm_tiles(4096, 512, 132)[:2] == (128, 128) and kernels._gemm_tiles(8, 512, 132)[:2] == (16, 32)
    monkeypatch.setattr(kernels, "_sms", lambda index: 1000)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # so gemm_triton asks _sms
    x, w = torch.randn(37, 300), torch.randn(150, 300) * 0.05
    xq, xs = quantize_act(x)
    wq, ws = quantize_weight(w)
    exact = dequantize_act(xq, xs).double() @ dequantize_weight(wq, ws).double().t()
    assert kernels._gemm_tiles(37, 150, 1000)[1] == 32
    assert rel(kernels.gemm_triton(xq, wq, xs, ws, out_dtype=torch.float32), exact) < 1e-3
    # a tile shape a GPU's Triton will not build: the product still comes, on the fixed tiles, logged, kept
    monkeypatch.setenv("PRIMERL_FP8_GEMM_TILES", "occupancy")  # restored after the test
    launch, tried = kernels._launch_gemm, []

    def no_narrow_tiles(*args):  # noqa: ANN002
        tried.append(args[-1][:2])
        if args[-1][1] == 32:
            raise RuntimeError("this Triton builds no 32-wide tile")
        return launch(*args)

    monkeypatch.setattr(kernels, "_launch_gemm", no_narrow_tiles)
    assert rel(kernels.gemm_triton(xq, wq, xs, ws, out_dtype=torch.float32), exact) < 1e-3
    assert tried == [(64, 32), (64, 64)] and os.environ["PRIMERL_FP8_GEMM_TILES"] == "fixed"
    kernels.gemm_triton(xq, wq, xs, ws)
    assert tried[-1] == (64, 64)  # the fixed tiles from then on, no second failure


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_match_float64_on_cuda():
    from node.fp8.kernels import quantize_act_triton

    _cases("cuda")
    x = torch.randn(64, 1000, device="cuda")  # float32 input (the cases above quantise bf16)
    _same_quantisation(*quantize_act_triton(x), *quantize_act(x), "float32")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_equals_eager_decode():
    from benchmarks.fixed_decode import FixedBatchDecoder
    from node.engine.fp8.model import quantize_model_fp8
    from node.model.config import ModelConfig
    from node.model.qwen3_moe import CausalLM

    cfg = ModelConfig(vocab_size=128, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=2,
                      num_experts=8, num_experts_per_tok=2, head_dim=32)
    torch.manual_seed(0)
    m = quantize_model_fp8(CausalLM(cfg).to("cuda", torch.bfloat16).eval())
    prompt = torch.randint(0, 128, (4, 6), device="cuda")
    # Teacher-forced: both decoders are fed the same tokens, and their logits must agree. (Greedy
    # sequences can part at a near-tie: the MoE combine's index_add_ sums a token's expert outputs
    # with atomics, in an order that varies from run to run, so bf16 results vary in the last bit.)
    eager, graphed = FixedBatchDecoder(m, 4, 20, use_graph=False), FixedBatchDecoder(m, 4, 20, use_graph=True)
    tokens = eager.greedy(prompt, 10)
    graphed.prefill(prompt)
    eager.prefill(prompt)
    for i in range(9):
        pos = torch.full((4,), 6 + i, device="cuda", dtype=torch.long)
        a, b = eager.step(tokens[:, i], pos).float(), graphed.step(tokens[:, i], pos).float()
        assert ((a - b).norm() / a.norm()) < 2e-2


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_fp8_moe_block_quantises_its_tokens_once_before_dispatching_them(device, monkeypatch):
    """On the Triton path `FP8GroupedExperts.dispatchable` quantises the block's T tokens and `dispatch` copies the
    e4m3 rows to the experts: the block's output is bit for bit the one of quantising each of the T x k copies (the
    way before; per-row quantisation commutes with taking rows). Off it (the reference path) the rows stay a tensor."""
    from node.engine.fp8.model import FP8GroupedExperts, place
    from node.fp8.ops import QuantizedRows
    from node.model.moe import MoEBlock

    torch.manual_seed(0)
    block = MoEBlock(256, 128, num_experts=8, top_k=2, norm_topk_prob=True)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    block.experts = FP8GroupedExperts(block.experts, top_k=2)
    x = torch.randn(37, 256).to(torch.bfloat16)
    assert block.experts.dispatchable(x) is x  # the CPU's reference path: each expert's rows quantised there
    triton_on(device, monkeypatch)
    monkeypatch.setenv("PRIMERL_FP8_TRITON", "1")
    block, x = place(block, device, torch.bfloat16), x.to(device)
    taken: list = []
    forward = block.experts.forward
    monkeypatch.setattr(block.experts, "forward", lambda rows, counts: taken.append(rows) or forward(rows, counts))
    out, routing = block(x)
    assert isinstance(taken[0], QuantizedRows) and taken[0].shape == (37 * 2, 256) and taken[0].dtype == torch.bfloat16
    monkeypatch.setattr(block.experts, "dispatchable", lambda rows: rows)  # every copy quantised by the product
    before, _ = block(x)
    assert isinstance(taken[1], torch.Tensor) and out.dtype == torch.bfloat16
    assert torch.equal(out, before) and out.abs().sum() > 0
    if device == "cuda":  # and the fused SwiGLU + quantisation: the bytes of torch's ops (the way before, same block)
        monkeypatch.setenv("PRIMERL_FP8_FUSED", "0")
        unfused, _ = block(x)
        assert torch.equal(out, unfused)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fp8_attention_quantises_its_input_once_for_q_k_and_v(device, monkeypatch):
    """`Attention.projections` of FP8 projections on the Triton path: the normed input quantised once
    (`FP8Linear.prepared`) and its rows given to q, k and v, bit for bit what each projection quantising it again
    makes (one activation kernel a layer instead of three). Off it (the reference path) x is passed as it is."""
    from node.engine.fp8.model import place, quantize_model_fp8
    from node.fp8.ops import QuantizedRows
    from node.model.config import ModelConfig
    from node.model.qwen3_moe import Attention

    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    attn = Attention(cfg, 0)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.05)
    attn = quantize_model_fp8(torch.nn.ModuleDict({"layers": torch.nn.ModuleList([attn])})).layers[0]
    x = torch.randn(3, 11, 256).to(torch.bfloat16)
    assert not isinstance(attn.q_proj.prepared(x), QuantizedRows)
    triton_on(device, monkeypatch)
    monkeypatch.setenv("PRIMERL_FP8_TRITON", "1")
    attn, x = place(attn, device, torch.bfloat16), x.to(device)
    taken: list = []
    for name in ("q_proj", "k_proj", "v_proj"):
        proj = getattr(attn, name)
        monkeypatch.setattr(proj, "forward", (lambda f: lambda rows: taken.append(rows) or f(rows))(proj.forward))
    q, k, v = attn.projections(x)
    assert len(taken) == 3 and all(t is taken[0] for t in taken) and isinstance(taken[0], QuantizedRows)
    assert q.shape == (3, 11, 4, 128) and k.shape == v.shape == (3, 11, 2, 128)
    for got, proj, heads in ((q, attn.q_proj, 4), (k, attn.k_proj, 2), (v, attn.v_proj, 2)):
        want = proj(x).view(3, 11, heads, 128)
        assert torch.equal(got, want) and want.abs().sum() > 0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_fused_swiglu_quantises_what_torchs_ops_make(device, monkeypatch):
    """`silu_mul_quant_triton` (one pass over a SwiGLU's [gate | up] rows) against torch's silu, product and the
    reference quantisation: on a GPU the same bytes (IEEE division, libdevice's expf, the product rounded to bf16
    as torch rounds it); in the interpreter (numpy's exp, its own e4m3 cast) near the quantisation kernel's there."""
    triton_on(device, monkeypatch)
    import torch.nn.functional as F

    from node.fp8.kernels import quant_act_rows, quantize_act_triton, silu_mul_quant_triton

    torch.manual_seed(0)
    for m, i in ((5, 300), (70, 768), (1100, 256)):
        gu = (torch.randn(m, 2 * i, device=device) * torch.rand(m, 1, device=device) * 6).to(torch.bfloat16)
        q, s = silu_mul_quant_triton(gu)
        gate, up = gu.chunk(2, dim=-1)
        h = (F.silu(gate) * up).contiguous()
        rq, rs = quantize_act(h)
        assert q.shape == (m, i) and s.shape == rs.shape and quant_act_rows(m) in (1, 8, 32)
        if device == "cuda":
            _same_quantisation(q, s, rq, rs, (m, i))
        else:
            assert torch.allclose(s, rs, rtol=2e-2, atol=0), (m, i)  # amax one bf16 step apart at most
            assert rel(dequantize_act(q, s), dequantize_act(*quantize_act_triton(h))) < 0.05, (m, i)

