"""Sequences packed end to end in one row: a batch with no padding, each sequence attending causally to itself.

A long-tailed batch padded to a rectangle spends its padded positions in every projection and expert (26% more
token rows than real ones on the 30B validator's RL batch, and each padded row routed to k experts); packed, every
row is a real token, and only attention needs to know where each sequence starts (`cu_seqlens`). On a GPU in
bf16/fp16 the attention is flash attention's variable-length kernel; elsewhere one causal attention per sequence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
_gqa_native: bool | None = None
"""Whether this torch's variable-length flash kernel took k/v with fewer heads than q (found at the first call)."""
_varlen_failed: str | None = None
"""Why this torch's variable-length flash kernel failed, once it has (then nothing is packed: `varlen_usable`)."""


@dataclass(frozen=True)
class Packed:
    """Where each of the row's sequences starts: `lengths` in order, `cu_seqlens` [n + 1] int32 on the device."""

    lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor
    max_len: int

    @classmethod
    def of(cls, lengths: list[int] | tuple[int, ...], device: torch.device | str) -> Packed:
        if not lengths or min(lengths) < 1:
            raise ValueError(f"packed sequences need one token each at least, got lengths {list(lengths)[:8]}")
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
        return cls(tuple(lengths), cu.to(device), max(lengths))

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """[1, N]: each sequence's positions from 0."""
        lens = torch.tensor(self.lengths)
        starts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        return (torch.arange(self.tokens) - starts)[None].to(device)


def varlen_status() -> dict:
    """What this process found of the variable-length flash kernel: `failed` (why, or None) and `gqa_native` (k/v
    with fewer heads than q taken as they are; None before the first call)."""
    return {"failed": _varlen_failed, "gqa_native": _gqa_native}


def varlen_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed attention runs as one flash kernel on `device` in `dtype` (else a loop over sequences)."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and _varlen_failed is None


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Causal attention within each packed sequence: q [1, NH, N, D], k and v [1, NKV, N, D] -> [1, NH, N, D]."""
    global _varlen_failed
    if varlen_usable(q.device, q.dtype):
        try:
            return _varlen(q, k, v, packed)
        except (RuntimeError, TypeError) as e:  # this torch's kernel or its signature: said once, never silent
            _varlen_failed = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            log.warning("variable-length flash attention failed (%s): packed rows attend one sequence at a time, "
                        "and prefills pad their sequences from now on", _varlen_failed)
    nh, nkv = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    start = 0
    for n in packed.lengths:
        s = slice(start, start + n)
        out[:, :, s] = F.scaled_dot_product_attention(q[:, :, s], k[:, :, s], v[:, :, s], is_causal=True,
                                                      enable_gqa=nh != nkv)
        start += n
    return out


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed) -> torch.Tensor:
    global _gqa_native
    nh, nkv = q.shape[1], k.shape[1]
    qt, kt, vt = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # [N, heads, D]
    if nh != nkv and _gqa_native is not False:
        try:
            out = _flash_varlen(qt, kt, vt, packed)
            _gqa_native = True
            return out.transpose(0, 1)[None]
        except RuntimeError as e:  # an older kernel wants as many k/v heads as q heads
            _gqa_native = False
            log.warning("variable-length flash attention refused %d k/v heads for %d q heads (%s): k and v "
                        "repeated per q head", nkv, nh, str(e).splitlines()[0][:200])
    if nh != nkv:
        kt, vt = kt.repeat_interleave(nh // nkv, dim=1), vt.repeat_interleave(nh // nkv, dim=1)
    return _flash_varlen(qt, kt, vt, packed).transpose(0, 1)[None]


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed) -> torch.Tensor:
    cu = packed.cu_seqlens
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, packed.max_len, packed.max_len, 0.0, True, False)
    return out[0]
