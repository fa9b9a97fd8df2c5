"""Triton kernels: activation quantisation, block-scaled FP8 GEMM, grouped (per-expert) GEMM.

Imported only when Triton is present (CUDA machines, or CPU with TRITON_INTERPRET=1 for tests).
Every kernel accumulates in float32 and applies the two scales once per 128-wide K block, the
DeepSeek-V3 recipe: the tensor cores see e4m3 x e4m3, the scales are applied on the way out of
each block, so a 128x128 weight scale costs one multiply per output element per K block.

The grouped kernel takes rows already sorted by expert and the experts' row counts on the device; each
program finds its expert's rows from them, so it launches a grid fixed by the shapes with no host
synchronisation: a decode step that calls it can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from node.fp8.quantize import BLOCK, FP8_DTYPE, FP8_MAX

log = logging.getLogger(__name__)


@triton.jit
def _quant_act_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, GROUP: tl.constexpr,
                      ROWS: tl.constexpr):
    # ROWS rows x one GROUP-wide block a program (one row a program made a grid of rows x K / 128 programs of 256
    # bytes each: 160 ms of a 30B validator's 1.18 s of kernels for 64 claims on an H100, ~9x off bandwidth)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    live = rows < M
    mask = live[:, None] & (offs < K)[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    _quant_store(x, rows, g, offs, live, mask, q_ptr, s_ptr, stride_qm, stride_sm)


@triton.jit
def _quant_store(x, rows, g, offs, live, mask, q_ptr, s_ptr, stride_qm, stride_sm):
    # float32 x [ROWS, GROUP] -> e4m3 + one scale a row, divided as `quantize.quantize_act` divides (IEEE-rounded
    # division: Triton's `/` on float32 is approximate, which left scales one ulp from the reference on an H100)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    q = tl.clamp(tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape)), -448.0, 448.0)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + offs[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows.to(tl.int64) * stride_sm + g, scale, mask=live)


@triton.jit
def _silu_mul_quant_kernel(gu_ptr, q_ptr, s_ptr, M, I, stride_gm, stride_qm, stride_sm, GROUP: tl.constexpr,
                           ROWS: tl.constexpr, LIBDEVICE: tl.constexpr):
    # rows of [gate | up] (bf16, I each) -> silu(gate) * up rounded to bf16 as torch's two kernels round it (silu
    # in float32 as x / (1 + exp(-x)) with IEEE division and libdevice's expf, then the product), quantised. (Triton's
    # interpreter has no libdevice: there LIBDEVICE is off and numpy's exp serves.)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    live = rows < M
    mask = live[:, None] & (offs < I)[None, :]
    base = gu_ptr + rows[:, None].to(tl.int64) * stride_gm + offs[None, :]
    gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + I, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    act = tl.math.div_rn(gate, 1.0 + e).to(gu_ptr.dtype.element_ty).to(tl.float32)
    h = (act * up).to(gu_ptr.dtype.element_ty).to(tl.float32)
    _quant_store(h, rows, g, offs, live, mask, q_ptr, s_ptr, stride_qm, stride_sm)


def quant_act_rows(m: int) -> int:
    """Rows one program of `_quant_act_kernel` quantises: 32 for prefill-sized inputs, fewer for a decode step's
    few rows (the grid still spreads over the GPU's SMs)."""
    return 32 if m > 1024 else 8 if m > 64 else 1


def quantize_act_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `quantize.quantize_act` for a 2-D tensor with unit stride on K."""
    return _quantised_rows(_quant_act_kernel, x, x.shape[1])


def silu_mul_quant_triton(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gu [M, 2I] (a SwiGLU's gate columns, then its up columns) -> `quantize_act(silu(gate) * up)` in one pass, the
    product rounded to gu's dtype first as torch's ops round it (one read of gu, no bf16 intermediate written)."""
    return _quantised_rows(_silu_mul_quant_kernel, gu, gu.shape[1] // 2,
                           LIBDEVICE=os.environ.get("TRITON_INTERPRET") != "1")


def _quantised_rows(kernel, x: torch.Tensor, k: int, **consts) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """e4m3 [M, k] and float32 scales [M, k / 128] from `kernel` over the rows of x, a program per row tile and group."""
    m = x.shape[0]
    kb = triton.cdiv(k, BLOCK)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, kb), dtype=torch.float32, device=x.device)
    if m:
        rows = quant_act_rows(m)
        kernel[(triton.cdiv(m, rows), kb)](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), GROUP=BLOCK,
                                           ROWS=rows, **consts)
    return q, s


@triton.jit
def _gemm_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr,
    M, N, K,
    stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
    B_GROUP_N: tl.constexpr, SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Grouped launch order: GROUP_M row tiles share each column tile while it is in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_left = K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < k_left), other=0.0)
        if SCALED:
            sa = tl.load(as_ptr + offs_m * stride_asm + kb, mask=mask_m, other=0.0)
            sb = tl.load(bs_ptr + (offs_n // B_GROUP_N) * stride_bsn + kb, mask=mask_n, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


DECODE_ROWS = 256
"""Up to this many rows a GEMM is decode-sized: its tiles are chosen to occupy the GPU (`_gemm_tiles`)."""


@functools.lru_cache(maxsize=None)
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count if torch.cuda.is_available() else 1


def _fixed_tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by rows alone: the tiles before session 20, and any GEMM's
    with PRIMERL_FP8_GEMM_TILES=fixed (an A/B, or the fallback of `gemm_triton`)."""
    if m <= 16:
        return 16, 64, 4, 4
    if m <= 64:
        return 64, 64, 4, 4
    return 128, 128, 8, 3


def _gemm_tiles(m: int, n: int, sms: int = 1) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by problem size. Decode-sized rows (m <= DECODE_ROWS): BLOCK_N
    is halved from 128 (down to 32) while the grid would have fewer programs than the GPU has SMs (`sms`): with
    fixed 128 x 128 tiles a batch-128 decode step's k / v projection (N 512) ran as 4 programs on 132 SMs, and
    the dense FP8 GEMMs took 3.5 ms of the step's 27 ms of kernels for 0.9 GB of weights on an H100 (session
    20's profile)."""
    if os.environ.get("PRIMERL_FP8_GEMM_TILES") == "fixed" or m > DECODE_ROWS:
        return _fixed_tiles(m)
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    rows = triton.cdiv(m, bm)
    bn = 128
    while bn > 32 and rows * triton.cdiv(n, bn) < sms:
        bn //= 2
    return bm, bn, 4 if bm * bn <= 64 * 64 else 8, 4


def gemm_triton(
    a: torch.Tensor, b: torch.Tensor, a_s: torch.Tensor | None = None, b_s: torch.Tensor | None = None,
    b_group_n: int = BLOCK, out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """c [M, N] = a [M, K] @ b [N, K]^T; scaled FP8 when scales are given, plain otherwise."""
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    scaled = a_s is not None
    tiles = _gemm_tiles(m, n, _sms(a.device.index or 0) if a.is_cuda else 1)
    try:
        _launch_gemm(a, b, c, a_s, b_s, b_group_n, tiles)
    except Exception as exc:  # noqa: BLE001 - a tile shape this GPU's Triton will not build: the fixed tiles, logged
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if os.environ.get("PRIMERL_FP8_GEMM_TILES") == "fixed" or capturing:
            raise
        log.error("FP8 GEMM tiles %s failed (%s: %s); PRIMERL_FP8_GEMM_TILES=fixed from now on", tiles[:2],
                  type(exc).__name__, str(exc)[:200])
        os.environ["PRIMERL_FP8_GEMM_TILES"] = "fixed"
        _launch_gemm(a, b, c, a_s, b_s, b_group_n, _fixed_tiles(m))
    return c


def _launch_gemm(a, b, c, a_s, b_s, b_group_n: int, tiles: tuple[int, int, int, int]) -> None:  # noqa: ANN001
    (m, k), n, scaled = a.shape, b.shape[0], a_s is not None
    bm, bn, warps, stages = tiles
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _gemm_kernel[grid](
        a, b, c, a_s if scaled else a, b_s if scaled else b,
        m, n, k,
        a.stride(0), b.stride(0), c.stride(0),
        a_s.stride(0) if scaled else 0, b_s.stride(0) if scaled else 0,
        B_GROUP_N=b_group_n, SCALED=scaled,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK, GROUP_M=8,
        num_warps=warps, num_stages=stages,
    )


@triton.jit
def _grouped_kernel(
    x_ptr, w_ptr, c_ptr, xs_ptr, ws_ptr, counts_ptr,
    E, N, K,
    stride_xm, stride_we, stride_wn, stride_cm, stride_xsm, stride_wse, stride_wsn,
    SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E_POW2: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    # which expert's rows this row tile holds, from the counts themselves: experts' tiles laid end to end, expert
    # e the one whose tiles end past this one (a table built by a dozen torch ops before each product cost 0.4 ms of
    # host time a layer at the 30B validator's shape); a tile past the last expert's exits
    idx = tl.arange(0, E_POW2)
    cnt = tl.load(counts_ptr + idx, mask=idx < E, other=0).to(tl.int32)
    tiles = (cnt + BLOCK_M - 1) // BLOCK_M
    e = tl.sum((tl.cumsum(tiles, 0) <= tile).to(tl.int32), 0)
    if e >= E:
        return
    before = idx < e
    first_row = tl.sum(tl.where(before, cnt, 0), 0)
    start = first_row + (tile - tl.sum(tl.where(before, tiles, 0), 0)) * BLOCK_M
    end = first_row + tl.sum(tl.where(idx == e, cnt, 0), 0)
    offs_m = start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < end
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_left = K - kb * BLOCK_K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < k_left), other=0.0)
        if SCALED:
            sx = tl.load(xs_ptr + offs_m * stride_xsm + kb, mask=mask_m, other=0.0)
            sw = tl.load(ws_ptr + e * stride_wse + (offs_n // BLOCK_K) * stride_wsn + kb, mask=mask_n, other=0.0)
            acc += tl.dot(x, w) * sx[:, None] * sw[None, :]
        else:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def grouped_block_m(rows: int, experts: int) -> int:
    """Row-tile height for the grouped kernel: small when each expert sees few rows (decode)."""
    per_expert = rows / max(experts, 1)
    for bm in (16, 32, 64):
        if per_expert <= bm:
            return bm
    return 128


def grouped_tiles(rows: int, experts: int, fp8: bool = True) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the grouped kernel for `rows` routed rows over `experts`, its
    operands e4m3 (`fp8`) or 16-bit (the plain comparison path keeps the tiles before: twice the bytes a stage).
    PRIMERL_FP8_GROUPED_TILES="BM,BN,WARPS,STAGES" sets them for prefill-sized products (more than 64 rows an
    expert: benchmarks.fp8_kernels --grouped-tiles prints the best it found, benchmarks.real_scale judges with it).
    Prefill-sized products take 64 x 256 tiles, 8 warps, 4 stages: of 23 configurations swept on an H100 at the
    Qwen3-30B-A3B expert shapes (128 experts, top-8; 2,048 and 11,500 tokens) the fastest for three of the four
    products and faster than the 128 x 128 x 8 x 3 before for all (1.04-1.26x; 64 claims of a 30B validator judged
    in 2.4 s against 2.8 s, every verdict the same: session 28, `benchmarks/results/fp8_grouped_tiles-s28-h100.json`).
    Each product sums its 128-wide K blocks in the same order; the swept configurations changed no bf16 output bit
    at those shapes, but tile heights whose MMA instructions differ (16 against 64 rows, session 29's GPU test) move
    low bits of float32 outputs."""
    bm = grouped_block_m(rows, experts)
    if fp8 and bm == 128:
        if given := os.environ.get("PRIMERL_FP8_GROUPED_TILES"):
            try:
                bm, bn, warps, stages = (int(v) for v in given.split(","))
                return bm, bn, warps, stages
            except ValueError:
                log.warning("PRIMERL_FP8_GROUPED_TILES=%r is not BM,BN,WARPS,STAGES: the tiles in force", given)
        return 64, 256, 8, 4
    return bm, 64 if bm <= 32 else 128, 4 if bm <= 32 else 8, 4 if bm <= 64 else 3


def grouped_gemm_triton(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
    x_s: torch.Tensor | None = None, w_s: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16, config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """c [T, N]: rows of x [T, K] (sorted by expert, counts [E]) times w[e] [N, K]^T, on a grid fixed by the
    shapes alone (each program finds its expert's rows from `counts` on the device: no host synchronisation, so a
    decode step that calls it can be captured in a CUDA graph). `config`: (BLOCK_M, BLOCK_N, num_warps,
    num_stages) instead of `grouped_tiles`' (benchmarks.fp8_kernels --grouped-tiles sweeps them)."""
    t, k = x.shape
    e, n, _ = w.shape
    c = torch.empty((t, n), dtype=out_dtype, device=x.device)
    if t == 0:
        return c
    bm, bn, warps, stages = config or grouped_tiles(t, e, fp8=x_s is not None)
    max_tiles = triton.cdiv(t, bm) + e  # every expert's last tile may be partial
    scaled = x_s is not None
    _grouped_kernel[(max_tiles, triton.cdiv(n, bn))](
        x, w, c, x_s if scaled else x, w_s if scaled else w, counts,
        e, n, k,
        x.stride(0), w.stride(0), w.stride(1), c.stride(0),
        x_s.stride(0) if scaled else 0, w_s.stride(0) if scaled else 0, w_s.stride(1) if scaled else 0,
        SCALED=scaled, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK, E_POW2=triton.next_power_of_2(e),
        num_warps=warps, num_stages=stages,
    )
    return c


__all__ = [
    "FP8_MAX", "gemm_triton", "grouped_block_m", "grouped_gemm_triton", "grouped_tiles",
    "quantize_act_triton", "silu_mul_quant_triton",
]
