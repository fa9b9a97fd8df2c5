"""Context parallelism for long sequences: ring attention. Each of `cp` ranks holds one contiguous
slice of every sequence (its queries, activations, MLP/MoE work and loss tokens); keys and values
travel round the ring, one rank's block at a time, and each rank merges the blocks' attention with
an online softmax (log-sum-exp), so no rank ever holds more than two K/V blocks and no T x T (or
T_local x T) mask or score matrix exists: each block runs in the flash-attention kernel (CUDA:
`_scaled_dot_product_flash_attention`, CPU: its `_for_cpu` twin), causal on the diagonal block,
skipped above it (slices are in rank order: rank r's queries see blocks 0..r).

Backward: the kernel's backward per block with the merged output and log-sum-exp (so each block's
gradient is its share of the whole softmax); K/V go round the ring again with their gradient
accumulators, which arrive back at their owner after cp hops. Sends overlap the block compute
(`batch_isend_irecv`). Gradients equal one process's up to float reassociation.

Applied from outside: `Attention.forward` is replaced on each instance; the q/k/v + RoPE prelude is the
model's own (`Attention.rotated_qkv`), only the attention after it differs. Rotary embeddings are
right because the model gets the global positions of the slice. GQA: K/V travel with their own
(fewer) heads and are expanded per block.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from node.model.qwen3_moe import Attention


def _exchange(t: torch.Tensor, group) -> tuple[torch.Tensor, list]:
    """Send `t` to the next rank of the ring, receive the previous rank's (asynchronously)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    recv = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, (r + 1) % n)),
           dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (r - 1) % n))]
    return recv, dist.batch_isend_irecv(ops)


def _wait(reqs: list) -> None:
    for req in reqs:
        req.wait()


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(g: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradient of `_expand`: sum each KV head's query group."""
    if groups == 1:
        return g
    b, h, t, d = g.shape
    return g.view(b, h // groups, groups, t, d).sum(2)


def _block_fwd(q, k, v, causal: bool):
    if q.is_cuda:
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False)
        return out, lse, (cq, ck, mq, mk, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse, None


def _block_bwd(dout, q, k, v, out, lse, causal: bool, extra):
    if q.is_cuda:
        cq, ck, mq, mk, seed, offset = extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries [B, H, T_l, D] over the whole sequence, whose K/V
    [B, H_kv, T_l, D] are spread over the ring `group` in rank order."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        groups = q.shape[1] // k.shape[1]
        kv = torch.stack([k, v]).contiguous()
        acc = torch.promote_types(q.dtype, torch.float32)  # merge in fp32 (fp64 stays fp64)
        out = lse = None
        extras = {}
        for i in range(n):
            src = (r - i) % n
            if i < n - 1:
                nxt, reqs = _exchange(kv, group)
            if src <= r:
                o, l, extras[src] = _block_fwd(q, _expand(kv[0], groups), _expand(kv[1], groups), src == r)
                o, l = o.to(acc), l.to(acc)
                if out is None:
                    out, lse = o, l
                else:
                    merged = torch.logaddexp(lse, l)
                    out = out * torch.exp(lse - merged).unsqueeze(-1) + o * torch.exp(l - merged).unsqueeze(-1)
                    lse = merged
            if i < n - 1:
                _wait(reqs)
                kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.extras = group, extras
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        n, r = dist.get_world_size(group), dist.get_rank(group)
        groups = q.shape[1] // k.shape[1]
        dout = dout.contiguous()
        kv = torch.stack([k, v]).contiguous()
        acc = torch.promote_types(q.dtype, torch.float32)
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        for i in range(n):
            src = (r - i) % n
            if i < n - 1:
                nxt, reqs = _exchange(kv, group)
            if src <= r:
                dq_b, dk_b, dv_b = _block_bwd(dout, q, _expand(kv[0], groups), _expand(kv[1], groups), out, lse,
                                              src == r, ctx.extras[src])
                dq += dq_b.to(acc)
                dkv[0] += _fold(dk_b.to(acc), groups)
                dkv[1] += _fold(dv_b.to(acc), groups)
            dkv, dreqs = _exchange(dkv, group)  # the accumulator follows its K/V; home after n hops
            _wait(dreqs)
            if i < n - 1:
                _wait(reqs)
                kv = nxt
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group)


def _cp_forward(self: Attention, x, positions, rope_cs, cache, slots):
    if cache is not None:
        raise ValueError("context parallelism is for training forwards; the KV cache is the engine's")
    b, t, _ = x.shape
    q, k, v = self.rotated_qkv(x, rope_cs)
    out = ring_attention(q, k, v, self.cp_group)
    return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def shard_context(attn: Attention, cp_group: dist.ProcessGroup) -> None:
    attn.cp_group = cp_group
    attn.forward = types.MethodType(_cp_forward, attn)


def sequence_slice(length: int, cp_rank: int, cp: int) -> slice:
    """This rank's slice of a sequence padded to a multiple of cp (contiguous, in rank order:
    ring attention relies on it)."""
    per = -(-length // cp)
    return slice(cp_rank * per, (cp_rank + 1) * per)
