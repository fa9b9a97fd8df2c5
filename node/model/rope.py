"""Rotary position embeddings, with the frequency schedules this project supports.

`default`: inv_freq_i = theta^(-2i/d). `linear`: positions divided by `factor`. `llama3`
(Llama 3.1+): frequencies whose wavelength exceeds original_max / low_freq_factor are divided by
`factor`, those shorter than original_max / high_freq_factor kept, and the band between blended
smoothly. Other schedules (yarn, dynamic, longrope) are refused when config.json is read.
"""

from __future__ import annotations

import math

import torch

from node.model.config import ModelConfig


def inv_frequencies(cfg: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies of `cfg`'s rotary embedding."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    if rs.rope_type == "linear":
        return inv / rs.factor
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, T, D] of the rotary embedding at positions [B, T] (computed once per forward)."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half convention) of x [B, H, T, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
