"""DeepGEMM as the FP8 grouped GEMM of decode-sized expert batches (optional extra).

DeepGEMM (github.com/deepseek-ai/DeepGEMM, pinned commit in pyproject's `deepgemm` extra and
docs/fp8.md) JIT-compiles its kernels with nvcc at first use; it is imported, never vendored.
Its masked grouped GEMM takes each expert's rows in a padded [E, capacity, K] block plus a row
count per expert, which fits decode: at batch 256 x top-8 each of 128 experts sees ~16 rows,
where our Triton grouped kernel is 2.5x slower than torch bf16 and DeepGEMM 1.7x faster
(../shared/DESIGN.md, "Decode-sized expert GEMMs"). Same numerics as the Triton path: e4m3
inputs, 1x128 activation scales, 128x128 weight scales, float32 accumulation.
Every step is device-side (no host sync), so it runs inside a captured decode step.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)
_broken: str | None = None


class DeepGEMMUnavailable(RuntimeError):
    """DeepGEMM asked for (PRIMERL_FP8_GROUPED=deepgemm) but not importable or not on Hopper."""


def usable() -> bool:
    """False once a DeepGEMM call failed (its JIT compile, say): later calls take Triton."""
    return _broken is None


def disable(reason: str) -> None:
    global _broken
    _broken = reason
    log.error("DeepGEMM failed (%s); FP8 grouped GEMMs fall back to the Triton kernel", reason)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when `deep_gemm` imports and the current CUDA device is Hopper (sm_90)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    try:
        import deep_gemm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means the Triton path
        return False
    return True


def masked_grouped_gemm(x_q: torch.Tensor, x_s: torch.Tensor, counts: torch.Tensor, w: torch.Tensor,
                        w_s: torch.Tensor, capacity: int, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """c [T, N]: rows of x_q [T, K] (e4m3, sorted by expert, counts [E], scales x_s [T, K/128]) times
    w[e] [N, K]^T (e4m3, scales w_s [E, N/128, K/128]); no expert may have more than `capacity` rows."""
    import deep_gemm

    # Each expert's block must hold whole row tiles: the kernel loads and stores BLOCK_M (64 or 128)
    # rows per tile, so with a capacity that is not a multiple, a tile of expert e spills into the
    # rows of expert e + 1 (seen on the H200: rare NaN and wrong rows, benchmarks/results/logs/).
    capacity = -(-capacity // 128) * 128
    t, k = x_q.shape
    e, n, _ = w.shape
    counts = counts.to(torch.int32)
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = torch.arange(t, device=x_q.device, dtype=torch.int32)
    expert = torch.searchsorted(ends, rows, right=True).clamp_(max=e - 1).long()
    slot = (rows - (ends - counts)[expert]).long()
    lhs = torch.empty(e, capacity, k, dtype=torch.uint8, device=x_q.device)
    lhs[expert, slot] = x_q.view(torch.uint8)
    lhs_s = torch.ones(e, capacity, x_s.shape[1], dtype=torch.float32, device=x_q.device)
    lhs_s[expert, slot] = x_s
    out = torch.empty(e, capacity, n, dtype=torch.bfloat16, device=x_q.device)
    deep_gemm.m_grouped_gemm_fp8_fp8_bf16_nt_masked(
        (lhs.view(torch.float8_e4m3fn), lhs_s), (w, w_s), out, counts, max(1, t // e))
    return out[expert, slot].to(out_dtype)
