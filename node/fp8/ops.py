"""FP8 operations with one signature on every device: Triton on CUDA, the torch reference elsewhere.

Invariant: the CUDA and CPU paths compute the same function (same quantisation, same per-block
scaling, float32 accumulation); only the summation order differs. CPU tests of the model path
therefore exercise the numerics that the GPU runs.
Set PRIMERL_FP8_TRITON=1 to force the Triton path (with TRITON_INTERPRET=1 it runs on CPU, slowly).
Grouped (expert) GEMMs go to our Triton kernel (a "swapped" twin for decode batches, weight rows on the MMA's
long side, was measured in session 20 on an H100: 4,440 vs 4,421 tok/s at batch 128, no gain, so removed: the
kernel moves the experts' weights at ~78% of the H100's bandwidth there); with PRIMERL_FP8_GROUPED=auto (DeepGEMM when
importable on Hopper) or =deepgemm (required), decode-sized batches go to DeepGEMM's masked kernel
(`fp8/deepgemm.py`). Triton is the default because on the H200 (docs/fp8.md) DeepGEMM gave no
speed-up inside the captured step, and its masked layout produced wrong rows until the capacity
was rounded to whole tiles (that fix is not yet re-measured on a GPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from node.fp8.quantize import BLOCK, UnsupportedTensor, quantize_act, reference_gemm


DEEPGEMM_MAX_TOKENS = 512
"""Largest token count (rows / top-k) sent to DeepGEMM's masked kernel; larger batches go to Triton."""


def deepgemm_shape(w: torch.Tensor) -> bool:
    """Shapes DeepGEMM 1.0.0's masked kernel compiles for: K a multiple of 256, N of 128 (its
    uniform-B-scale path needs an even number of K scale blocks)."""
    return w.shape[-1] % 256 == 0 and w.shape[-2] % 128 == 0


def grouped_backend(device: torch.device | str | None = None) -> str:
    """Which kernel serves FP8 expert GEMMs on `device`: 'deepgemm-masked+triton', 'triton' or 'torch'."""
    choice = os.environ.get("PRIMERL_FP8_GROUPED", "triton")
    if device is not None and torch.device(device).type != "cuda" and os.environ.get("PRIMERL_FP8_TRITON") != "1":
        return "torch"
    if choice not in ("auto", "deepgemm"):
        return "triton"
    from node.fp8.deepgemm import DeepGEMMUnavailable, available, usable

    if available() and usable():
        return "deepgemm-masked+triton"
    if choice == "deepgemm":
        raise DeepGEMMUnavailable("PRIMERL_FP8_GROUPED=deepgemm but deep_gemm is not importable on a Hopper GPU")
    return "triton"


def triton_available() -> bool:
    """True when the Triton kernels can run for tensors on this machine's default device."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _use_triton(t: torch.Tensor) -> bool:
    if os.environ.get("PRIMERL_FP8_TRITON") == "1":
        return triton_available()
    return t.is_cuda and triton_available()


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K/128)])."""
    if _use_triton(x):
        from node.fp8.kernels import quantize_act_triton

        return quantize_act_triton(x.contiguous())
    return quantize_act(x)


def scaled_gemm(
    a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor,
    b_group_n: int = BLOCK, out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """[M, N] = dequant(a_q, a_s) @ dequant(b_q, b_s)^T; b has 128x128 blocks or (b_group_n=1) row groups."""
    if a_q.shape[1] != b_q.shape[1]:
        raise UnsupportedTensor(f"contraction mismatch: {tuple(a_q.shape)} x {tuple(b_q.shape)}^T")
    if _use_triton(a_q):
        from node.fp8.kernels import gemm_triton

        return gemm_triton(a_q, b_q, a_s, b_s, b_group_n=b_group_n, out_dtype=out_dtype)
    return reference_gemm(a_q, a_s, b_q, b_s, b_group_n).to(out_dtype)


def fp8_linear(x: torch.Tensor | QuantizedRows, w_q: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T with W block-quantised; x is quantised per token per group (given as
    `QuantizedRows` [M, K], quantised already: y is [M, N])."""
    if isinstance(x, QuantizedRows):
        return scaled_gemm(x.q, x.s, w_q, w_s, out_dtype=x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    x_q, x_s = quantize_activation(x2)
    return scaled_gemm(x_q, x_s, w_q, w_s, out_dtype=x.dtype).view(*lead, w_q.shape[0])


def fused() -> bool:
    """Whether FP8 experts quantise before dispatch and fuse their SwiGLU with the next quantisation (the default;
    PRIMERL_FP8_FUSED=0: the torch ops and a quantisation per product, the way before session 28, same function)."""
    return os.environ.get("PRIMERL_FP8_FUSED", "1") != "0"


@dataclass(frozen=True)
class QuantizedRows:
    """Activation rows already quantised per row per 128 channels (e4m3 `q` [M, K], float32 `s` [M, K/128]) and
    the dtype the products come back in. Per-row quantisation commutes with taking rows, so an FP8 MoE block
    quantises its T tokens once and dispatches their top-k copies in e4m3: T rows quantised instead of T x k, and
    a copy of half the bytes (`FP8GroupedExperts.dispatchable`). Rows are taken as from a tensor."""

    q: torch.Tensor
    s: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def __getitem__(self, rows) -> QuantizedRows:  # noqa: ANN001 - any tensor index
        return QuantizedRows(self.q[rows], self.s[rows], self.dtype)


def quantized_rows(x: torch.Tensor) -> QuantizedRows | torch.Tensor:
    """`x` quantised as `QuantizedRows` where the Triton kernels take it (else `x` as it is: the reference path
    quantises each expert's rows itself, the same function)."""
    if not _use_triton(x) or not fused():
        return x
    q, s = quantize_activation(x)
    return QuantizedRows(q, s, x.dtype)


def swiglu(gu: torch.Tensor) -> QuantizedRows | torch.Tensor:
    """silu(gate) * up of a SwiGLU's [gate | up] rows: on the Triton path fused with the next product's
    quantisation (one pass over gu, `QuantizedRows` out: node/fp8/kernels.py `silu_mul_quant_triton`, the same
    bf16 rounding as these ops), else the torch ops."""
    if _use_triton(gu) and fused():
        from node.fp8.kernels import silu_mul_quant_triton

        return QuantizedRows(*silu_mul_quant_triton(gu.contiguous()), gu.dtype)
    gate, up = gu.chunk(2, dim=-1)
    return (F.silu(gate) * up).contiguous()


def grouped_linear(
    x: torch.Tensor | QuantizedRows, counts: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor | None = None,
    capacity: int | None = None,
) -> torch.Tensor:
    """Rows of x [T, K] sorted by expert (counts [E]) times w[e] [N, K]^T.

    With w_s the weight is e4m3 with 128x128 block scales and x is quantised per row per group;
    without it this is the plain (bf16) grouped product, the comparison path. `capacity` (the most
    rows any expert can have: the token count) lets decode-sized batches take DeepGEMM. `x` may come quantised
    (`QuantizedRows`, Triton path and e4m3 `w` only).
    """
    if isinstance(x, QuantizedRows):
        if w_s is None or not _use_triton(x.q):
            raise UnsupportedTensor("quantised rows take the Triton path and an e4m3 weight with block scales")
        return _grouped_fp8(x, counts, w, w_s, capacity)
    if _use_triton(x):
        x = x.contiguous()
        if w_s is None:
            from node.fp8.kernels import grouped_gemm_triton

            return grouped_gemm_triton(x, w, counts, out_dtype=x.dtype)
        return _grouped_fp8(QuantizedRows(*quantize_activation(x), x.dtype), counts, w, w_s, capacity)
    out = x.new_empty((x.shape[0], w.shape[1]))
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            rows = x[start : start + c]
            if w_s is None:
                out[start : start + c] = rows @ w[e].t()
            else:
                out[start : start + c] = fp8_linear(rows, w[e], w_s[e])
        start += c
    return out


def _grouped_fp8(x: QuantizedRows, counts: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
                 capacity: int | None) -> torch.Tensor:
    """The grouped FP8 product on a GPU: DeepGEMM's masked kernel for decode-sized batches where chosen, else
    (and from a failed compile on) our Triton kernel."""
    from node.fp8.kernels import grouped_gemm_triton

    if (capacity is not None and capacity <= DEEPGEMM_MAX_TOKENS and x.q.is_cuda and deepgemm_shape(w)
            and grouped_backend(x.q.device) == "deepgemm-masked+triton"):
        from node.fp8 import deepgemm

        try:
            return deepgemm.masked_grouped_gemm(x.q, x.s, counts, w, w_s, capacity, out_dtype=x.dtype)
        except Exception as exc:  # noqa: BLE001 - a JIT compile failure: logged, Triton from now on
            if torch.cuda.is_current_stream_capturing():
                raise
            deepgemm.disable(f"{type(exc).__name__}: {str(exc)[:200]}")
    return grouped_gemm_triton(x.q, w, counts, x.s, w_s, out_dtype=x.dtype)
