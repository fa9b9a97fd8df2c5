"""Slot-based KV cache for the engine: one slot per running sequence, each with its own length.

A sequence owns a slot from its prefill until it finishes; its keys and values live at
`k[layer][slot, 0:length]` (layout [slot, position, kv_head, head_dim], so that writing one
token of every sequence is a single `index_copy_` into a flat view). Slots are reused, never
shared, so sequences that started under an older policy version keep their own cache (new
sequences never reuse KV built by an older version).
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (num_slots, max_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.num_slots = num_slots

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Store k/v ([B, Hkv, T, D]) at `positions` ([B, T]) of `slots` ([B])."""
        self.write_rows(layer, (slots[:, None] * self.max_len + positions).reshape(-1), k_new, v_new)

    def write_rows(self, layer: int, flat: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Store k/v ([B, Hkv, T, D], rows in B-major order) at flat cache rows `flat` ([B * T]: slot * max_len +
        position): a packed prefill's tokens, each of its own slot."""
        for cache, new in ((self.k[layer], k_new), (self.v[layer], v_new)):
            cache.view(-1, *cache.shape[2:]).index_copy_(0, flat, new.transpose(1, 2).reshape(-1, *cache.shape[2:]))

    def write_and_read(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
                       k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v, then return each slot's keys and values up to the largest position, [B, Hkv, L, D].
        Ascending, contiguous slots (what the engine passes when it can) are read as a view, not gathered."""
        self.write(layer, slots, positions, k_new, v_new)
        length = int(positions.max()) + 1
        first, n = int(slots[0]), slots.numel()
        if int(slots[-1]) - first + 1 == n and (n < 3 or bool((slots[1:] > slots[:-1]).all())):
            rows = slice(first, first + n)
        else:
            rows = slots
        return self.k[layer][rows, :length].transpose(1, 2), self.v[layer][rows, :length].transpose(1, 2)
