"""Tampered copies of a model (weight noise, fp8 or int8 rounding): the engines a cheater might run,
for the tamper tests and the threshold calibration (benchmarks/verification_calibration.py)."""

from __future__ import annotations

import copy

import torch


def perturb(model: torch.nn.Module, kind: str, seed: int = 1) -> torch.nn.Module:
    """A tampered copy: 'noise1pct' (weights x (1 + 0.01 N(0,1))), 'fp8' (e4m3 round trip with a
    per-row scale), 'int8' (symmetric per-row round trip). Norm weights are left alone."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                continue
            w = p.float()
            if kind == "noise1pct":
                q = w * (1 + 0.01 * torch.randn(p.shape, generator=g))
            else:
                scale = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
                if kind == "fp8":
                    q = (w / scale * 448.0).to(torch.float8_e4m3fn).float() / 448.0 * scale
                elif kind == "int8":
                    q = (w / scale * 127.0).round() / 127.0 * scale
                else:
                    raise ValueError(kind)
            p.copy_(q.to(p.dtype))
    return m
