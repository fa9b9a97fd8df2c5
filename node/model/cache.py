"""Slot-based KV cache for the engine: one slot per running sequence, each with its own length.

A sequence owns a slot from its prefill until it finishes; its keys and values live at
`k[layer][slot, :, 0:length]`. Slots are reused, never shared, so sequences that started under an
older policy version keep their own cache (new sequences never reuse KV built by an older version).
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.num_slots = num_slots

    def write_and_read(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
                       k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v ([B, Hkv, T, D]) at `positions` ([B, T]) of `slots` ([B]); return each slot's
        keys and values up to the largest position, [B, Hkv, L, D]."""
        idx = slots[:, None]
        self.k[layer][idx, :, positions] = k_new.transpose(1, 2)
        self.v[layer][idx, :, positions] = v_new.transpose(1, 2)
        length = int(positions.max()) + 1
        return self.k[layer][slots, :, :length], self.v[layer][slots, :, :length]
