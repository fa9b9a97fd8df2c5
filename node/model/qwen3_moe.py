"""One causal LM in plain PyTorch: the Qwen3-MoE layout (dense Qwen3 and Llama as special cases).

Read top to bottom: embeddings -> N x [RMSNorm -> attention (GQA, per-head q/k RMSNorm, RoPE)
-> residual -> RMSNorm -> MLP or MoE -> residual] -> RMSNorm -> LM head. Parameter names are
Hugging Face's, so checkpoints load in `transformers` and vLLM. Parallelism and quantisation are
applied from outside (see moe.py); the KV cache is optional and passed in by the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from node.model.cache import KVCache
from node.model.config import ModelConfig
from node.model.moe import MoEBlock, load_balancing_loss
from node.model.packed import Packed, packed_attention
from node.model.rope import inv_frequencies, rope, rope_tables


FUSED_NORM: ContextVar[Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None] = ContextVar(
    "fused_norm", default=None)
"""RMSNorm as one kernel, (x, weight, eps) -> y, where a caller sets it (the validator's recomputation on a GPU:
`node.replay.judging_kernels`, with the engine's own Triton kernel): used on CUDA tensors outside autograd only,
so a trainer's forward and backward stay the module's."""
FUSED_ROPE: ContextVar[Callable[..., tuple[torch.Tensor, torch.Tensor]] | None] = ContextVar("fused_rope", default=None)
"""q/k per-head RMSNorm and rotary embedding as one kernel, (q, k, cos, sin, norms) -> (q, k) where a caller sets it
(the engine's forward and the validator's recomputation on a GPU: `node.engine.rope_kernels.norm_rope`): used on
CUDA tensors outside autograd only, as `FUSED_NORM` is."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = FUSED_NORM.get()
        if fused is not None and x.is_cuda and not torch.is_grad_enabled():
            return fused(x, self.weight, self.eps)
        if x.is_cuda and torch.is_grad_enabled():  # a trainer's forward on a GPU: PyTorch's fused kernel and its
            # backward, one pass over x each way (the ops below make ~8 float32 passes forward and ~15 backward, a
            # large share of a training step's elementwise time); x * rstd * weight rounded once, in float32
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [..., NH, D], k and v [..., NKV, D] of normed input x [..., H], before any norm or rotation. Projections
        that take their input prepared (an FP8 one's `prepared`: the rows quantised) get it made once for the three."""
        lead = x.shape[:-1]
        prepared = getattr(self.q_proj, "prepared", None)
        src = prepared(x) if prepared is not None and type(self.k_proj) is type(self.v_proj) is type(self.q_proj) else x
        q = self.q_proj(src).view(*lead, self.n_heads, self.head_dim)
        k = self.k_proj(src).view(*lead, self.n_kv, self.head_dim)
        v = self.v_proj(src).view(*lead, self.n_kv, self.head_dim)
        return q, k, v

    def qkv(self, x: torch.Tensor, norm: Callable[[RMSNorm, torch.Tensor], torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prelude before rotation: q [..., NH, D], k and v [..., NKV, D] of normed input x [..., H],
        q and k RMS-normed per head. `norm(module, t)` stands in for the norms' own forward (the CUDA
        engine's fused kernel); the decode step rotates q and k itself, fused with the cache write."""
        q, k, v = self.projections(x)
        if self.q_norm is not None:
            q, k = (self.q_norm(q), self.k_norm(k)) if norm is None else (norm(self.q_norm, q), norm(self.k_norm, k))
        return q, k, v

    def rotated_qkv(self, x: torch.Tensor, rope_cs: tuple[torch.Tensor, torch.Tensor],
                    norm: Callable[[RMSNorm, torch.Tensor], torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole prelude, what every attention of this model (this forward, the engine's prefill,
        ring attention) starts with: q [B, NH, T, D], k and v [B, NKV, T, D] of x [B, T, H], q and k
        rotated by `rope_cs` (`rope_tables` of the positions). Where a caller set `FUSED_ROPE` (CUDA, no autograd),
        q and k are normed and rotated in one kernel, the same function as the engine's norm kernel (which `norm`
        stands for there) and `rope`."""
        fused = FUSED_ROPE.get()
        if fused is not None and x.is_cuda and not torch.is_grad_enabled():
            q, k, v = self.projections(x)
            norms = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            q, k = fused(q, k, *rope_cs, norms)
            return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k, v = self.qkv(x, norm)
        return rope(q.transpose(1, 2), *rope_cs), rope(k.transpose(1, 2), *rope_cs), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope_cs: tuple[torch.Tensor, torch.Tensor],
                cache: KVCache | None, slots: torch.Tensor | None, packed: Packed | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.rotated_qkv(x, rope_cs)
        if packed is not None:  # one row of sequences end to end, each causal within itself
            if cache is not None:
                raise ValueError("packed sequences keep their keys in a PackedKV (packed.context), not a KV cache")
            if packed.context is not None:  # parts of longer sequences: their keys so far
                k, v = packed.context.kv.write_and_read(self.layer, k, v, packed.context)
            return self.o_proj(packed_attention(q, k, v, packed).transpose(1, 2).reshape(b, t, -1))
        if cache is None:
            mask = None
        else:
            k, v = cache.write_and_read(self.layer, slots, positions, k, v)
            key_pos = torch.arange(k.shape[2], device=x.device)
            mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, L]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_heads != self.n_kv
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(layer):
            self.mlp = MoEBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                cfg.num_experts_per_tok, cfg.norm_topk_prob)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, positions, rope_cs, cache, slots, replay, packed=None):
        attend = (cache, slots) if packed is None else (cache, slots, packed)  # a context-parallel attention
        # (node/rl/parallel/context.py, training only) takes no `packed`
        x = x + self.self_attn(self.input_layernorm(x), positions, rope_cs, *attend)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoEBlock):
            y, routing = self.mlp(h, replay)
            return x + y, routing
        return x + self.mlp(h), None


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V]
    hidden: torch.Tensor  # [B, T, H] final hidden states (after the last norm)
    router_logits: list[torch.Tensor]  # per MoE layer, [B*T, E]
    routed_experts: torch.Tensor | None  # [B, T, n_moe_layers, k]
    aux_loss: torch.Tensor  # load-balancing loss (0 for dense models)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=std)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, slots: torch.Tensor | None = None,
                routed_experts: torch.Tensor | None = None, logits_at: int | torch.Tensor | None = None,
                packed: Packed | None = None, logits_rows: torch.Tensor | None = None) -> ModelOutput:
        """`routed_experts` [B, T, n_moe_layers, k] replays given experts (router replay), of any integer dtype (a
        trainer's batch holds them as compact as the wire does, `compact_routes_dtype`; widened here, on the device).
        `logits_at` bounds the LM head's work (with a 49k-151k vocabulary it is most of the memory):
        an int s keeps positions s.. ([B, T - s, V]); a [B] tensor one position per row ([B, 1, V]).
        `logits_rows` (instead): flat indices into the B x T positions, logits [N, V] of those only (a trainer's
        loss positions: no prompt or padding row through the LM head and the log-softmax after it).
        `packed`: input_ids [1, N] are its sequences end to end (node/model/packed.py), no KV cache; or parts of
        longer ones (`PackedKV.part`), each at its own positions over the keys its earlier parts wrote."""
        b, t = input_ids.shape
        if routed_experts is not None and routed_experts.dtype != torch.long:
            routed_experts = routed_experts.long()
        if packed is not None and (b != 1 or packed.tokens != t):
            raise ValueError(f"packed sequences of {packed.tokens} tokens in one row, got input ids {b} x {t}")
        if positions is None:
            positions = (torch.arange(t, device=input_ids.device).expand(b, t) if packed is None
                         else packed.positions(input_ids.device))
        x = self.model.embed_tokens(input_ids)
        rope_cs = rope_tables(positions, inv_frequencies(self.config, positions.device), x.dtype)
        router_logits, chosen = [], []
        moe_i = 0
        for layer in self.model.layers:
            replay = None
            if routed_experts is not None and isinstance(layer.mlp, MoEBlock):
                replay = routed_experts[:, :, moe_i].reshape(b * t, -1)
            x, routing = layer(x, positions, rope_cs, cache, slots, replay, packed)
            if routing is not None:
                router_logits.append(routing.logits)
                chosen.append(routing.experts)
                moe_i += 1
        hidden = self.model.norm(x)
        if logits_rows is not None:
            logits = self.lm_head(hidden.reshape(b * t, -1).index_select(0, logits_rows))
        elif logits_at is None:
            logits = self.lm_head(hidden)
        elif isinstance(logits_at, int):
            logits = self.lm_head(hidden[:, logits_at:])
        else:
            logits = self.lm_head(hidden[torch.arange(b, device=hidden.device), logits_at.to(hidden.device)][:, None])
        experts = torch.stack([c.view(b, t, -1) for c in chosen], dim=2) if chosen else None
        # the balancing loss only matters where there is a gradient; inference skips it
        if chosen and torch.is_grad_enabled():
            aux = load_balancing_loss(router_logits, chosen, self.config.num_experts)
        else:
            aux = hidden.new_zeros(())
        return ModelOutput(logits, hidden, router_logits, experts, aux)
