"""The prefill's fused q/k norm and rotation (`rope_kernels.norm_rope`) against the engine's norm kernel and the
model's `rope`: on a GPU, and on the CPU in Triton's interpreter where Triton is installed (CI has none: skipped)."""

import pytest
import torch
from triton_on import triton_on

from node.model.config import ModelConfig
from node.model.qwen3_moe import FUSED_ROPE, Attention, rope, rope_tables
from node.model.rope import inv_frequencies


def _attention(device: str, qk_norm: bool) -> tuple[Attention, ModelConfig]:
    cfg = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, model_type="qwen3_moe" if qk_norm else "llama",
                      rope_theta=1e6)
    torch.manual_seed(3)
    attn = Attention(cfg, 0)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.06)
    return attn.to(device=device, dtype=torch.bfloat16), cfg


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_norm_rope_is_the_norm_kernel_then_rope(device, qk_norm, monkeypatch):
    """Each element of q and k as the engine's RMSNorm kernel and then `rope` make it (the same roundings: on a GPU
    equal wherever the two rotations' bf16 products round alike, within one step of their terms elsewhere), and
    the attention prelude takes it where `FUSED_ROPE` is set, outside autograd only."""
    triton_on(device, monkeypatch)
    from node.engine.forward import fused_kernels
    from node.engine.norm_kernels import rms_norm
    from node.engine.rope_kernels import norm_rope

    attn, cfg = _attention(device, qk_norm)
    b, t = 3, 37
    x = torch.randn(b, t, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    positions = torch.arange(t, device=device).expand(b, t) + torch.tensor([[0], [5], [900]], device=device)
    cos, sin = rope_tables(positions, inv_frequencies(cfg, x.device), x.dtype)
    with torch.no_grad():
        q, k, v = attn.projections(x)
        norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if qk_norm else None
        got_q, got_k = norm_rope(q, k, cos, sin, norms)
        if qk_norm:
            q, k = rms_norm(q, *norms[::2]), rms_norm(k, *norms[1:])
        for src, got in ((q, got_q), (k, got_k)):
            want = rope(src.transpose(1, 2), cos, sin).transpose(1, 2)
            assert got.shape == want.shape and got.dtype == want.dtype
            xf, c, s = src.float(), cos.transpose(1, 2).float(), sin.transpose(1, 2).float()
            half = src.shape[-1] // 2
            terms = (xf * c).abs() + (torch.cat([-xf[..., half:], xf[..., :half]], -1) * s).abs()
            assert bool(((got.float() - want.float()).abs() <= terms * 2**-6 + 2**-14).all())
            # most elements round the same way; a kernel that normed or rotated otherwise would agree on almost none
            assert float((got == want).float().mean()) > (0.5 if device == "cuda" else 0.3)
        with fused_kernels(True):
            assert FUSED_ROPE.get() is norm_rope
            fq, fk, fv = attn.rotated_qkv(x, (cos, sin))
        assert FUSED_ROPE.get() is None
    if device == "cuda":  # the module path on a CPU tensor never takes it (CUDA only)
        assert torch.equal(fq.transpose(1, 2), got_q) and torch.equal(fk.transpose(1, 2), got_k)
        assert torch.equal(fv, v.transpose(1, 2))
        with fused_kernels(True):  # autograd on: the model's ops, whose backward exists
            tq, _, _ = attn.rotated_qkv(x, (cos, sin))
        assert tq.requires_grad


def test_norm_rope_refuses_tables_of_other_positions(monkeypatch):
    triton_on("cpu", monkeypatch)
    from node.engine.rope_kernels import norm_rope

    q, k = torch.zeros(2, 5, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 5, 2, 64, dtype=torch.bfloat16)
    cos = torch.zeros(2, 1, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="8 positions, 10 rows"):
        norm_rope(q, k, cos, cos, None)
