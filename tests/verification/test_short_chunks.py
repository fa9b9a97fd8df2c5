"""A chunk of one or two tokens of a narrow model: its top-k is the whole block, near-zero entries
included, whose bf16 ulps are rounding noise (`hidden_check.MANTISSA_SHARE`). Noise there passes;
the same difference on the block's largest entries still fails."""

from __future__ import annotations

import torch

from verification.checks import THRESHOLDS, Severity, check_hidden
from verification.hidden_check import compare_blocks
from verification.proof import commit, topk_points


def _with_mantissa_error(block: torch.Tensor, idx: torch.Tensor, ulps: int) -> tuple[torch.Tensor, int]:
    """`block` with up to `ulps` added to the mantissa of the entries at `idx` (exponents kept, so each
    magnitude only grows within its binade), and the total ulps added."""
    bits = block.view(torch.int16).to(torch.int32) & 0xFFFF
    b = bits[idx]
    new = (b & ~0x7F) | ((b & 0x7F) + ulps).clamp(max=127)
    bits[idx] = new
    return bits.to(torch.int16).view(torch.bfloat16), int((new - b).sum())


def test_rounding_noise_on_a_one_token_chunks_smallest_entries_passes_and_on_its_largest_fails():
    prover = torch.randn(64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)  # 1 token, H = 64
    commitments = commit(topk_points([prover]))
    order = prover.float().abs().argsort()  # smallest first
    t = THRESHOLDS["bfloat16"]
    assert check_hidden(compare_blocks([prover], commitments), 0, t) is None  # the same numbers pass
    # the 16 smallest entries off by up to 40 ulps: over all 64 entries a mean past the 3.5 threshold
    noisy, added = _with_mantissa_error(prover, order[:16], 40)
    assert added / 64 > 2 * t.max_mant_err_mean
    small = compare_blocks([noisy], commitments)[0]
    assert small.exp_mismatches == 0 and small.mant_err_mean == 0.0
    assert check_hidden([small], 0, t) is None
    tampered, added = _with_mantissa_error(prover, order[-16:], 40)
    large = compare_blocks([tampered], commitments)[0]
    assert large.mant_err_mean == added / 32  # the largest half is read
    failure = check_hidden([large], 0, t)
    assert failure is not None and failure.severity == Severity.PROOF


def test_full_chunks_are_read_as_before():
    g = torch.Generator().manual_seed(4)
    prover = torch.randn(32 * 64, generator=g).to(torch.bfloat16)  # 32 tokens: top 128 of 2,048
    commitments = commit(topk_points([prover]))
    order = prover.float().abs().argsort()
    # every entry of the top 128 is read: up to 40 ulps on the 16 largest count over all 128
    tampered, added = _with_mantissa_error(prover, order[-16:], 40)
    stats = compare_blocks([tampered], commitments)[0]
    assert stats.exp_mismatches == 0 and stats.mant_err_mean == added / 128
    assert check_hidden([stats], 0, THRESHOLDS["bfloat16"]) is not None
