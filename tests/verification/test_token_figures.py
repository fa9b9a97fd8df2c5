"""The per-token figures of many segments computed together are those of each segment alone, bit for bit."""

import random

import torch

from verification import token_figures


def _random_segments(rng: random.Random, n: int) -> list[tuple]:
    segments = []
    for _ in range(n):
        size = rng.choice([1, 2, 3, 17, 32, 40, 129])
        tok = [rng.randrange(50) for _ in range(size)]
        lp = [-rng.random() * rng.choice([0.1, 3.0, 30.0]) for _ in range(size)]
        ours = torch.tensor(lp, dtype=torch.float32) + torch.randn(size) * rng.choice([0.0, 0.01, 0.3])
        for i in range(size):  # the edges: a NaN or an infinity recomputed, an exact tie for the worst error
            if rng.random() < 0.05:
                ours[i] = rng.choice([float("nan"), float("-inf"), ours[0].item()])
        replayed = torch.tensor([t if rng.random() < 0.8 else rng.randrange(50) for t in tok], dtype=torch.long)
        margins = torch.rand(size) * rng.choice([0.05, 1.0])
        segments.append((tok, lp, ours, replayed, margins))
    return segments


def test_segments_measured_together_get_the_figures_each_gets_alone():
    rng = random.Random(0)
    torch.manual_seed(0)
    for trial in range(40):
        segments = _random_segments(rng, rng.randrange(1, 12))
        together = token_figures.of_segments(*map(list, zip(*segments)), 0.25, 0.094)
        for seg, got in zip(segments, together):
            alone = token_figures.of_one(*seg, 0.25, 0.094)
            assert torch.equal(got.err, alone.err) and torch.equal(got.claimed_lp, alone.claimed_lp)
            assert torch.equal(got.claimed_tok, alone.claimed_tok) and torch.equal(got.sampling_bad, alone.sampling_bad)
            assert (got.over, got.worst, got.any_sampling_bad) == (alone.over, alone.worst, alone.any_sampling_bad)
            assert got.worst == float(alone.err[int(alone.err.argmax())])  # the error a failure names


def test_a_segment_with_a_nan_or_infinite_recomputation_has_an_infinite_worst_error():
    (fig,) = token_figures.of_segments([[1, 2]], [[-0.5, -0.1]], [torch.tensor([float("nan"), -0.1])],
                                       [torch.tensor([1, 2])], [torch.tensor([1.0, 1.0])], 0.25, 0.094)
    assert fig.worst == float("inf") and fig.over == 1 and not fig.any_sampling_bad


def test_a_segments_tokens_and_positions_picked_by_slice_are_those_picked_one_by_one():
    rng = random.Random(1)
    values = [rng.random() for _ in range(60)]
    for _ in range(300):
        start = rng.randrange(60)
        if rng.random() < 0.5:  # one run (a single-turn rollout), else ascending with gaps (tool tokens between)
            idx = list(range(start, rng.randrange(start, 61)))
        else:
            idx = sorted(rng.sample(range(60), rng.randrange(0, 20)))
        assert token_figures.picked(values, idx) == [values[i] for i in idx]
        assert token_figures.positions(7, idx) == [7 + i for i in idx]
