"""The validator's per-token measurement (`node.replay.measure_rows`), its inputs sent to the device once and
whole chunks noised or nucleus-cut without gathering rows, gives the figures the row-gathering rule gives."""

import random

import pytest
import torch
from triton_on import triton_on

from node.engine.sampling import gumbel_noise, token_seeds, top_p_mask
from node.replay import _row_chunks, measure_rows


def _row_by_row(parts, claimed, temps, top_p, seeds, chunk_rows):
    """`measure_rows` as first written (on the host): the nucleus and the noise through gathered rows."""
    n = len(claimed)
    temps_t = torch.tensor(temps, dtype=torch.float32)
    divisor = torch.where(temps_t > 0, temps_t, torch.ones_like(temps_t))
    claimed_t = torch.tensor(claimed, dtype=torch.long)
    top_p_t = torch.tensor(top_p, dtype=torch.float32)
    figures = torch.empty(3, n, dtype=torch.float32)
    for a, x in _row_chunks(parts, chunk_rows):
        b = a + x.shape[0]
        logp = torch.log_softmax(x.float() / divisor[a:b, None], dim=-1)
        figures[0, a:b] = logp.gather(-1, claimed_t[a:b, None]).squeeze(-1)
        scores = logp
        nucleus = (top_p_t[a:b] < 1).nonzero().squeeze(-1)
        if len(nucleus):
            scores = scores.clone()
            cut = ~top_p_mask(logp[nucleus], top_p_t[a:b][nucleus])
            scores[nucleus] = logp[nucleus].masked_fill(cut, float("-inf"))
        drawn = [r for r in range(a, b) if seeds[r] is not None]
        if drawn:
            local = torch.tensor([r - a for r in drawn], dtype=torch.long)
            scores = scores.index_add(0, local, gumbel_noise([seeds[r] for r in drawn], x.shape[-1]))
        top2 = scores.topk(2, dim=-1)
        figures[1, a:b] = top2.indices[:, 0].float()
        figures[2, a:b] = top2.values[:, 0] - top2.values[:, 1]
    return figures[0], figures[1].long(), figures[2]


def test_rows_measured_by_whole_chunks_get_the_figures_of_the_row_gathering_rule():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        vocab = rng.choice([5, 88, 300])
        parts = [torch.randn(rng.randrange(1, 40), vocab, generator=gen).bfloat16() * rng.choice([1, 4])
                 for _ in range(rng.randrange(1, 6))]
        n = sum(p.shape[0] for p in parts)
        mix = rng.choice(["sampled", "greedy", "mixed"])
        temps = [0.0 if mix == "greedy" or (mix == "mixed" and rng.random() < 0.4) else rng.choice([0.7, 1.0])
                 for _ in range(n)]
        top_p = [rng.choice([1.0, 0.9, 0.5]) for _ in range(n)] if rng.random() < 0.5 else [rng.choice([1.0, 0.8])] * n
        seed_of = token_seeds(rng.randrange(1 << 40), range(n))
        seeds = [s if t > 0 else None for s, t in zip(seed_of, temps)]
        claimed = [rng.randrange(vocab) for _ in range(n)]
        chunk = rng.choice([1, 7, 64, 1000])
        got = measure_rows(parts, claimed, temps, top_p, seeds, chunk)
        want = _row_by_row(parts, claimed, temps, top_p, seeds, chunk)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_fused_replay_gets_the_figures_of_the_torch_ops(device, monkeypatch):
    """`measure_rows` through `sampling_kernels.replay_triton` (two Triton passes, the noise drawn in the kernel) and
    through torch ops: the same replayed token wherever the margin is clear, the claimed log-probability and the
    margin within float32 rounding of a log-sum-exp reduced in another order, an infinite margin (a one-token
    nucleus) in the same rows. On the CPU in Triton's interpreter (small vocabularies), on a GPU at Qwen3's 151,936."""
    triton_on(device, monkeypatch)
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    vocabs = [5, 88, 300, 5000] if device == "cpu" else [88, 49_152, 151_936]
    for it in range(10 if device == "cpu" else 6):
        vocab = vocabs[it % len(vocabs)]
        rows = [rng.randrange(1, 12 if device == "cpu" else 300) for _ in range(rng.randrange(1, 4))]
        parts = [(torch.randn(r, vocab, generator=gen) * rng.choice([1, 4])).to(torch.bfloat16).to(device)
                 for r in rows]
        n = sum(rows)
        mix = ["sampled", "greedy", "mixed"][it % 3]
        temps = [0.0 if mix == "greedy" or (mix == "mixed" and rng.random() < 0.4) else rng.choice([0.7, 1.0])
                 for _ in range(n)]
        top_p = [rng.choice([1.0, 0.9, 0.5]) for _ in range(n)] if it % 2 else [rng.choice([1.0, 0.8])] * n
        seeds = [s if t > 0 else None for s, t in zip(token_seeds(rng.randrange(1 << 40), range(n)), temps)]
        claimed = [rng.randrange(vocab) for _ in range(n)]
        chunk = rng.choice([1, 7, 64, 1000])
        monkeypatch.setenv("PRIMERL_REPLAY", "torch")
        want = [t.cpu() for t in measure_rows(parts, claimed, temps, top_p, seeds, chunk)]
        monkeypatch.setenv("PRIMERL_REPLAY", "triton")
        got = [t.cpu() for t in measure_rows(parts, claimed, temps, top_p, seeds, chunk)]
        clear = want[2] > 1e-4
        assert clear.float().mean() > 0.5
        assert torch.equal(got[1][clear], want[1][clear])
        assert (got[0] - want[0]).abs().max() <= 1e-5 * max(1.0, float(want[0].abs().max()))
        finite = torch.isfinite(want[2])
        assert torch.equal(torch.isfinite(got[2]), finite)
        assert (got[2][finite] - want[2][finite]).abs().max() <= 1e-5 * max(1.0, float(want[2][finite].abs().max()))


def test_a_gpu_validator_recomputes_without_cudnn_attention_and_restores_the_process_setting(monkeypatch):
    """`judging_kernels`: on a GPU the recomputation's attention leaves cuDNN's kernel out (its per-call host cost)
    and the process's settings come back after; on the CPU, or with PRIMERL_JUDGE_SDPA=cudnn, nothing changes."""
    from node.replay import judging_kernels

    before = torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()
    with judging_kernels(on_device=True):
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()) == before
    with judging_kernels(on_device=False):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before[0]
    monkeypatch.setenv("PRIMERL_JUDGE_SDPA", "cudnn")
    with judging_kernels(on_device=True):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before[0]


def test_the_fused_norm_a_judge_sets_is_taken_on_a_gpu_outside_autograd_only():
    """`qwen3_moe.FUSED_NORM`: RMSNorm takes the kernel a caller set only for CUDA tensors with autograd off, so a
    trainer's forward (and any CPU forward) stays the module's; with no kernel set, the module's always."""
    from node.model.qwen3_moe import FUSED_NORM, RMSNorm

    calls = []
    norm = RMSNorm(8, 1e-6)
    x = torch.randn(3, 8)
    want = norm(x)
    token = FUSED_NORM.set(lambda *a: calls.append(a) or a[0])
    try:
        with torch.no_grad():
            assert torch.equal(norm(x), want)  # a CPU tensor: the module's
        assert torch.equal(norm(x), want) and calls == []
    finally:
        FUSED_NORM.reset(token)
    if torch.cuda.is_available():
        from node.engine.norm_kernels import rms_norm
        from node.replay import judging_kernels

        g = norm.cuda().to(torch.bfloat16)
        xg = (torch.randn(37, 8, device="cuda") * 3).to(torch.bfloat16)
        with torch.no_grad(), judging_kernels(on_device=True):
            assert torch.equal(g(xg), rms_norm(xg, g.weight, 1e-6))
        assert FUSED_NORM.get() is None
