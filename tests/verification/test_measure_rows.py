"""The validator's per-token measurement (`node.replay.measure_rows`), its inputs sent to the device once and
whole chunks noised or nucleus-cut without gathering rows, gives the figures the row-gathering rule gives."""

import random

import torch

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
