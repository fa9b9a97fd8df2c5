"""Decode attention over the slot KV cache, each row reading only its own sequence's length.

One query token per row; row b attends to keys [0, lens[b]) of cache slot slots[b]. Both are read
on the device, so one captured decode step serves any mix of sequence lengths. On CUDA a Triton
kernel (split-K "flash decoding": each program takes one row, one KV head with its query-head
group, and one slice of the keys; the slices' partial softmaxes are merged afterwards); elsewhere
the plain torch reference, which the kernel must match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK_N = 64


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """q [B, NH, D]; caches [S, L, NKV, D]; slots, lens [B] -> out [B, NH, D] (reference)."""
    b, nh, d = q.shape
    nkv = k_cache.shape[2]
    length = int(lens.max())
    k = k_cache[slots, :length].transpose(1, 2).repeat_interleave(nh // nkv, dim=1)  # [B, NH, L, D]
    v = v_cache[slots, :length].transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
    mask = (torch.arange(length, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask)[:, :, 0]


def num_splits(batch: int, num_kv_heads: int, max_len: int, sms: int = 132) -> int:
    """Key slices per (row, KV head): enough programs for two waves, slices of >= 256 keys."""
    want = -(-2 * sms // max(batch * num_kv_heads, 1))
    return max(1, min(want, max_len // 256))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, lens: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """Triton on CUDA, the torch reference elsewhere; same arguments as `decode_attention_torch`."""
    if not q.is_cuda:
        return decode_attention_torch(q, k_cache, v_cache, slots, lens)
    from node.engine.attention_kernels import decode_attention_triton

    if splits is None:
        splits = num_splits(q.shape[0], k_cache.shape[2], k_cache.shape[1])
    return decode_attention_triton(q, k_cache, v_cache, slots, lens, splits)

