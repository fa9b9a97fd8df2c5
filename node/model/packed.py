"""Sequences packed end to end in one row: a batch with no padding, each sequence attending causally to itself.

A long-tailed batch padded to a rectangle spends its padded positions in every projection and expert (26% more
token rows than real ones on the 30B validator's RL batch, and each padded row routed to k experts); packed, every
row is a real token, and only attention needs to know where each sequence starts (`cu_seqlens`). On a GPU in
bf16/fp16 the attention is flash attention's variable-length kernel; elsewhere one causal attention per sequence.

A sequence may also be computed in parts, one forward each (a mixed-version rollout: each policy version's tokens
under that version, node/replay.py `_PackedMixed`): `PackedKV` keeps every sequence's keys and values end to end,
a part writes its rows' and attends to all its sequence's keys so far, its queries aligned to the last keys (the
variable-length kernel's causal mask with fewer queries than keys: bottom-right, checked once a device,
`continued_usable`).
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
_continued: dict[tuple[str, torch.dtype], str | None] = {}
"""Per (device, dtype): why the variable-length kernel cannot continue a sequence (fewer queries than keys, the
causal mask aligned to the last key), or None where its output matched attention with that mask spelled out."""


@dataclass(frozen=True)
class Packed:
    """Where each of the row's sequences starts: `lengths` in order, `cu_seqlens` [n + 1] int32 on the device.
    `context`: the sequences are parts of longer ones whose earlier keys a `PackedKV` holds (`PackedKV.part`);
    `starts` then says at which position each part starts."""

    lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor
    max_len: int
    starts: tuple[int, ...] | None = None
    context: Continued | None = None

    @classmethod
    def of(cls, lengths: list[int] | tuple[int, ...], device: torch.device | str) -> Packed:
        if not lengths or min(lengths) < 1:
            raise ValueError(f"packed sequences need one token each at least, got lengths {list(lengths)[:8]}")
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
        return cls(tuple(lengths), to_device(cu, device), max(lengths))

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """[1, N]: each sequence's positions from 0 (from its `starts`, for parts)."""
        lens = torch.tensor(self.lengths)
        first = torch.cumsum(lens, 0) - lens
        if self.starts is not None:
            first = first - torch.tensor(self.starts)
        return to_device((torch.arange(self.tokens) - torch.repeat_interleave(first, lens))[None], device)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`; to a GPU from page-locked memory, queued behind the stream's work (a copy from
    pageable memory waits for the GPU's queue to empty, and the GPU then idles while the next kernels are launched:
    once a packed forward in a trainer, as `Trainer._on_device` avoids for the batch itself)."""
    device = torch.device(device)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


@dataclass(frozen=True)
class Continued:
    """What a packed part's attention reads beyond its own rows: the `PackedKV` its keys go into, the flat rows it
    writes (`write` [N]) and reads (`read`: each sequence's keys from position 0 to its part's end, in order), and
    those keys' `cu_seqlens_k` / `max_len_k`."""

    kv: PackedKV
    write: torch.Tensor
    read: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_len_k: int


class PackedKV:
    """Keys and values of sequences laid end to end, one flat [tokens, kv heads, head dim] buffer a layer, which
    forwards of their parts fill in turn (`part`). Memory: every token's keys and values of every layer."""

    def __init__(self, layers: int, lengths: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.lengths = list(lengths)
        self.offsets = [0]
        for n in self.lengths[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        shape = (sum(self.lengths), kv_heads, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.device = torch.device(device)

    def part(self, spans: list[tuple[int, int, int]]) -> Packed:
        """One forward's rows: (sequence, start, end) each, positions [start, end) of that sequence (sequences in
        any order, each once; its positions before `start` written by earlier parts)."""
        for j, a, b in spans:
            if not 0 <= a < b <= self.lengths[j]:
                raise ValueError(f"part [{a}, {b}) of a packed sequence of {self.lengths[j]} tokens")
        write = torch.cat([torch.arange(self.offsets[j] + a, self.offsets[j] + b) for j, a, b in spans])
        read = torch.cat([torch.arange(self.offsets[j], self.offsets[j] + b) for j, _, b in spans])
        cu_k = torch.zeros(len(spans) + 1, dtype=torch.int32)
        cu_k[1:] = torch.cumsum(torch.tensor([b for _, _, b in spans], dtype=torch.int32), 0)
        rows = Packed.of([b - a for _, a, b in spans], self.device)
        dev = self.device
        return Packed(rows.lengths, rows.cu_seqlens, rows.max_len, tuple(a for _, a, _ in spans),
                      Continued(self, write.to(dev, non_blocking=True), read.to(dev, non_blocking=True),
                                cu_k.to(dev, non_blocking=True), max(b for _, _, b in spans)))

    def write_and_read(self, layer: int, k: torch.Tensor, v: torch.Tensor, ctx: Continued
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a part's k/v ([1, NKV, N, D]) and return its sequences' keys and values so far, [1, NKV, Nk, D]."""
        out = []
        for buf, new in ((self.k[layer], k), (self.v[layer], v)):
            buf.index_copy_(0, ctx.write, new[0].transpose(0, 1))
            out.append(buf.index_select(0, ctx.read).transpose(0, 1)[None])
        return out[0], out[1]


def varlen_status() -> dict:
    """What this process found of the variable-length flash kernel: `failed` (why, or None) and `gqa_native` (k/v
    with fewer heads than q taken as they are; None before the first call)."""
    return {"failed": _varlen_failed, "gqa_native": _gqa_native}


def varlen_usable(device: torch.device, dtype: torch.dtype, continued: bool = False) -> bool:
    """Whether packed attention runs as one flash kernel on `device` in `dtype` (else a loop over sequences);
    `continued`: parts of sequences too (`continued_usable`)."""
    usable = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and _varlen_failed is None
    return usable and (not continued or continued_usable(device, dtype))


def continued_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the variable-length kernel aligns a part's queries to its last keys (the causal mask bottom-right, as
    flash attention 2.1 and later do), found once per device and dtype on 2 sequences of 3 queries over 7 and 3 keys
    against attention with that mask spelled out. Where it does not, mixed-version claims pad (logged once)."""
    key = (str(device), dtype)
    if key not in _continued:
        gen = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(1, 2, n, 64, generator=gen).to(device, dtype) for n in (6, 10, 10))
        parts = Packed(  # queries 4..6 of a 7-token sequence, then a 3-token sequence whole
            (3, 3), torch.tensor([0, 3, 6], dtype=torch.int32, device=device), 3, (4, 0),
            Continued(None, torch.empty(0), torch.empty(0),  # type: ignore[arg-type]
                      torch.tensor([0, 7, 10], dtype=torch.int32, device=device), 7))
        try:
            got = _varlen(q, k, v, parts).float()
            want = _attend_each(q.float(), k.float(), v.float(), parts)
            err = (got - want).abs().max().item()
            _continued[key] = None if err < 0.05 else f"it differs from bottom-right causal attention by {err:.3g}"
        except (RuntimeError, TypeError) as e:
            _continued[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        if _continued[key] is not None:
            log.warning("variable-length flash attention cannot continue a sequence on %s in %s (%s): mixed-version "
                        "claims are recomputed padded", device, dtype, _continued[key])
    return _continued[key] is None


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Causal attention within each packed sequence: q [1, NH, N, D], k and v [1, NKV, N, D] -> [1, NH, N, D]
    (`packed.context`: k and v [1, NKV, Nk, D], each sequence's keys so far, the queries aligned to the last)."""
    global _varlen_failed
    if varlen_usable(q.device, q.dtype, continued=packed.context is not None):
        try:
            return _varlen(q, k, v, packed)
        except (RuntimeError, TypeError) as e:  # this torch's kernel or its signature: said once, never silent
            _varlen_failed = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            log.warning("variable-length flash attention failed (%s): packed rows attend one sequence at a time, "
                        "and prefills pad their sequences from now on", _varlen_failed)
    return _attend_each(q, k, v, packed)


def _attend_each(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed) -> torch.Tensor:
    """`packed_attention` one sequence at a time (a part's queries see every key up to their own position)."""
    nh, nkv = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    keys = (packed.cu_seqlens if packed.context is None else packed.context.cu_seqlens_k).tolist()
    start = 0
    for i, n in enumerate(packed.lengths):
        s, ks = slice(start, start + n), slice(keys[i], keys[i + 1])
        m = keys[i + 1] - keys[i]
        mask = None  # a part's query at row r sees keys up to m - n + r (bottom-right); a whole sequence: causal
        if m != n:
            mask = torch.arange(m, device=q.device)[None] <= torch.arange(m - n, m, device=q.device)[:, None]
        out[:, :, s] = F.scaled_dot_product_attention(q[:, :, s], k[:, :, ks], v[:, :, ks], attn_mask=mask,
                                                      is_causal=mask is None, enable_gqa=nh != nkv)
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
    cu_k, max_k = (packed.cu_seqlens, packed.max_len) if packed.context is None else (
        packed.context.cu_seqlens_k, packed.context.max_len_k)
    out = torch.ops.aten._flash_attention_forward(q, k, v, packed.cu_seqlens, cu_k, packed.max_len, max_k, 0.0, True,
                                                  False)
    return out[0]
