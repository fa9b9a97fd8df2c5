"""Context parallelism for long sequences: each of `cp` ranks holds one contiguous slice of every
sequence (its queries, activations, MLP/MoE work and loss tokens) and all-gathers keys and values
for attention, as in Llama 3's all-gather CP. Memory for everything but K/V falls by cp; K/V is
whole on every rank (with GQA it is the small part). The gather's backward reduce-scatters the K/V
gradients, so gradients equal the one-process ones.

Applied from outside: `Attention.forward` is replaced on each instance. Rotary embeddings are
right because the model gets the global positions of the slice.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from node.model.qwen3_moe import Attention, rope


class _GatherSeq(torch.autograd.Function):
    """[B, H, T_local, D] from every CP rank -> [B, H, T_local * cp, D] in rank order; the backward
    sums every rank's gradient of the whole and keeps this rank's slice (a reduce-scatter).
    (torch.distributed.nn's all_gather is not used: on gloo its backward all-to-alls
    non-contiguous slices and returned wrong key/value gradients here.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        chunks = [c.contiguous() for c in grad.chunk(dist.get_world_size(group), dim=2)]
        mine = torch.empty_like(chunks[0])
        if dist.get_backend(group) == dist.Backend.GLOO:  # gloo has no reduce-scatter
            whole = grad.contiguous()
            dist.all_reduce(whole, group=group)
            mine.copy_(whole.chunk(len(chunks), dim=2)[dist.get_rank(group)])
        else:
            dist.reduce_scatter(mine, chunks, group=group)
        return mine, None


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherSeq.apply(x, group)


def _cp_forward(self: Attention, x, positions, rope_cs, cache, slots):
    if cache is not None:
        raise ValueError("context parallelism is for training forwards; the KV cache is the engine's")
    b, t, _ = x.shape
    q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
    k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim)
    v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
    if self.q_norm is not None:
        q, k = self.q_norm(q), self.k_norm(k)
    q = rope(q.transpose(1, 2), *rope_cs)
    k = rope(k.transpose(1, 2), *rope_cs)
    k, v = _gather_seq(k, self.cp_group), _gather_seq(v, self.cp_group)
    parts = [torch.empty_like(positions) for _ in range(dist.get_world_size(self.cp_group))]
    dist.all_gather(parts, positions.contiguous(), group=self.cp_group)
    key_pos = torch.cat(parts, dim=1)  # [B, T] global positions of the gathered keys
    mask = (key_pos[:, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T_local, T]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
    return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def shard_context(attn: Attention, cp_group: dist.ProcessGroup) -> None:
    attn.cp_group = cp_group
    attn.forward = types.MethodType(_cp_forward, attn)


def sequence_slice(length: int, cp_rank: int, cp: int) -> slice:
    """This rank's slice of a sequence padded to a multiple of cp."""
    per = -(-length // cp)
    return slice(cp_rank * per, (cp_rank + 1) * per)
