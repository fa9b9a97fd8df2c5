"""The CUDA engine's forward passes, walking a `CausalLM`'s own modules (same parameters, same
math as `CausalLM.forward`) but shaped for serving:

- `decode_step`: one token per row, rows at any mix of lengths; the KV write and the attention
  read cache slot slots[b] up to position pos[b] on the device (`attention.decode_attention`), so
  the step has fixed shapes and no host synchronisation and can be captured in a CUDA graph.
- `prefill_packed`: prompts end to end in one row, no padding (`node.model.packed`: flash attention's
  variable-length kernel on a GPU); each token's keys and values written to its own slot and position.
- `prefill_chunk`: a right-padded [B, T] chunk of prompts; the first chunk attends causally to
  its own keys (flash attention), later chunks of a long prompt read the cache with a mask (the engine's
  way for a prompt longer than its prefill budget).
All start each layer with the model's own attention prelude (`Attention.qkv`, `rotated_qkv`), so
a change to attention is one edit. Neither computes logits: the caller applies the LM head to the rows it samples from, which at a
151,936-token vocabulary is most of the cost of a prefill that computed all of them.
Quantised (FP8) projections and experts plug in as modules, as in the model.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from node.engine.attention import decode_attention
from node.model.cache import KVCache
from node.model.moe import FUSED_COMBINE, MoEBlock
from node.model.packed import Packed, packed_attention
from node.model.qwen3_moe import FUSED_ROPE, CausalLM, RMSNorm, rope, rope_tables
from node.model.rope import inv_frequencies


FUSED = os.environ.get("PRIMERL_FUSED_KERNELS", "1") == "1"
"""On CUDA: RMSNorm as one Triton kernel (`norm_kernels`) instead of the module's seven, and in
decode, q/k rotary embedding plus the KV-cache write as one (`rope_kernels`) instead of a dozen."""


def _norm(mod: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    if FUSED and x.is_cuda:
        from node.engine.norm_kernels import rms_norm

        return rms_norm(x, mod.weight, mod.eps)
    return mod(x)


def _mlp(layer, h: torch.Tensor, routes: list[torch.Tensor]) -> torch.Tensor:  # noqa: ANN001
    if isinstance(layer.mlp, MoEBlock):
        y, routing = layer.mlp(h)
        routes.append(routing.experts)
        return y
    return layer.mlp(h)


@contextmanager
def fused_kernels(on: bool) -> Iterator[None]:
    """While it lasts, where `on` (the engine's forwards, and the validator's recomputation of them on a GPU), on CUDA
    tensors outside autograd: MoE blocks combine their experts' rows in one kernel (`moe_kernels.moe_combine`, the
    model's `FUSED_COMBINE`), and attention norms and rotates q and k in one (`rope_kernels.norm_rope`, the model's
    `FUSED_ROPE`)."""
    if not on:
        yield
        return
    from node.engine.moe_kernels import moe_combine
    from node.engine.rope_kernels import norm_rope

    tokens = FUSED_COMBINE.set(moe_combine), FUSED_ROPE.set(norm_rope)
    try:
        yield
    finally:
        FUSED_ROPE.reset(tokens[1])
        FUSED_COMBINE.reset(tokens[0])


def decode_step(model: CausalLM, cache: KVCache, ids: torch.Tensor, pos: torch.Tensor,
                slots: torch.Tensor, splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    with fused_kernels(FUSED and ids.is_cuda):
        return _decode_step(model, cache, ids, pos, slots, splits)


def _decode_step(model: CausalLM, cache: KVCache, ids: torch.Tensor, pos: torch.Tensor,
                 slots: torch.Tensor, splits: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Feed ids [B] at positions pos [B] of cache slots [B]; returns (final hidden [B, H], routes
    [B, n_moe_layers, k] or None). Row b attends to positions 0..pos[b] of its slot."""
    cfg = model.config
    b = ids.shape[0]
    x = model.model.embed_tokens(ids)
    cos, sin = rope_tables(pos[:, None], inv_frequencies(cfg, x.device), x.dtype)  # [B, 1, 1, D]
    lens = pos + 1
    routes: list[torch.Tensor] = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        q, k, v = attn.qkv(_norm(layer.input_layernorm, x), _norm)  # [B, NH | NKV, D]
        if FUSED and x.is_cuda:
            from node.engine.rope_kernels import rope_and_write

            q = rope_and_write(q, k, v, cos[:, 0, 0], sin[:, 0, 0], slots, pos, cache.k[i], cache.v[i])
        else:
            q = rope(q[:, :, None], cos, sin)[:, :, 0]
            k = rope(k[:, :, None], cos, sin)[:, :, 0]
            cache.k[i][slots, pos] = k
            cache.v[i][slots, pos] = v
        o = decode_attention(q, cache.k[i], cache.v[i], slots, lens, splits)
        x = x + attn.o_proj(o.reshape(b, -1))
        x = x + _mlp(layer, _norm(layer.post_attention_layernorm, x), routes)
    hidden = _norm(model.model.norm, x)
    return hidden, torch.stack(routes, dim=1) if routes else None


def prefill_packed(model: CausalLM, ids: torch.Tensor, packed: Packed, cache: KVCache, slots: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [1, N]: whole prompts end to end (`packed`), each from position 0; token j's keys and values go to
    (slots[j], positions[j]) of `cache` (both [N]). Every row is a real token: a padded chunk of prompts of a
    heavy-tailed length computed its longest member's length for each (the RL task's prompts: 44 tokens mean, 207
    the longest). Returns (final hidden [1, N, H], routes [1, N, n_moe, k] | None)."""
    with fused_kernels(FUSED and ids.is_cuda):
        n = ids.shape[1]
        x = model.model.embed_tokens(ids)
        cos, sin = rope_tables(positions[None], inv_frequencies(model.config, x.device), x.dtype)
        flat = slots * cache.max_len + positions
        routes: list[torch.Tensor] = []
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            q, k, v = attn.rotated_qkv(_norm(layer.input_layernorm, x), (cos, sin), _norm)
            cache.write_rows(i, flat, k, v)
            o = packed_attention(q, k, v, packed)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(1, n, -1))
            x = x + _mlp(layer, _norm(layer.post_attention_layernorm, x), routes)
        return _norm(model.model.norm, x), torch.stack([r.view(1, n, -1) for r in routes], dim=2) if routes else None


def prefill_chunk(model: CausalLM, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                  slots: torch.Tensor | None = None, read_len: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids, positions [B, T] (right-padded). Without a cache, or with read_len 0 (every row's chunk
    starts at position 0), rows attend causally within the chunk; otherwise to cache positions
    [0, read_len) masked by position. Returns (final hidden [B, T, H], routes [B, T, n_moe, k] | None)."""
    with fused_kernels(FUSED and ids.is_cuda):
        return _prefill_chunk(model, ids, positions, cache, slots, read_len)


def _prefill_chunk(model: CausalLM, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | None,
                   slots: torch.Tensor | None, read_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    cfg = model.config
    b, t = ids.shape
    x = model.model.embed_tokens(ids)
    cos, sin = rope_tables(positions, inv_frequencies(cfg, x.device), x.dtype)  # [B, 1, T, D]
    routes: list[torch.Tensor] = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        q, k, v = attn.rotated_qkv(_norm(layer.input_layernorm, x), (cos, sin), _norm)
        if cache is not None:
            cache.write(i, slots, positions, k, v)
        if cache is None or read_len == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=attn.n_heads != attn.n_kv)
        else:
            rep = attn.n_heads // attn.n_kv
            kc = cache.k[i][slots, :read_len].transpose(1, 2).repeat_interleave(rep, dim=1)
            vc = cache.v[i][slots, :read_len].transpose(1, 2).repeat_interleave(rep, dim=1)
            mask = (torch.arange(read_len, device=ids.device)[None, None, :] <= positions[:, :, None])[:, None]
            o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        x = x + _mlp(layer, _norm(layer.post_attention_layernorm, x), routes)
    hidden = _norm(model.model.norm, x)
    return hidden, torch.stack([r.view(b, t, -1) for r in routes], dim=2) if routes else None
