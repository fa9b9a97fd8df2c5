"""Right padding and token-budget groups: what every batched prefill (engines, validator) builds on."""

import torch

import itertools
import random

from node.model.batching import padded_groups, right_pad, token_budget_groups


def test_right_pad_keeps_each_row_and_fills_the_rest():
    ids = right_pad([[5, 6, 7], [8], [9, 10]], fill=0)
    assert ids.dtype == torch.long and ids.shape == (3, 3)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert right_pad([[1], [2, 3]], fill=-1).tolist() == [[1, -1], [2, 3]]


def test_token_budget_groups_sort_by_length_and_bound_the_padded_tokens():
    lengths = [7, 2, 3, 2, 10, 3]
    groups = token_budget_groups(lengths, budget=8)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every sequence once
    assert [i for g in groups for i in g] == [1, 3, 2, 5, 0, 4]  # by length, ties in order
    assert groups == [[1, 3], [2, 5], [0], [4]]  # a third member would pad to 3 x 3 = 9 > 8; 10 > 8 stands alone
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 8


def test_a_budget_that_holds_everything_makes_one_group():
    assert token_budget_groups([4, 1, 3], budget=12) == [[1, 2, 0]]
    assert token_budget_groups([], budget=12) == []


def _cost(groups, lengths, overhead):
    return sum(len(g) * max(lengths[i] for i in g) for g in groups) + overhead * len(groups)


def _splits(lengths, budget):
    """Every split of the sorted lengths into contiguous runs within the budget (brute force)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    for cuts in itertools.product([False, True], repeat=len(order) - 1):
        groups, run = [], [order[0]]
        for i, cut in zip(order[1:], cuts):
            if cut:
                groups.append(run)
                run = []
            run.append(i)
        groups.append(run)
        if all(len(g) * max(lengths[i] for i in g) <= budget or len(g) == 1 for g in groups):
            yield groups


def test_padded_groups_are_the_least_padded_split_within_the_budget_and_never_worse_than_greedy():
    rng = random.Random(3)
    for _ in range(60):
        lengths = [rng.randint(1, 120) for _ in range(rng.randint(1, 10))]
        budget, overhead = rng.choice([40, 150, 400, 10_000]), rng.choice([0, 30, 10**9])
        groups = padded_groups(lengths, budget, overhead)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert all(len(g) * max(lengths[i] for i in g) <= budget or len(g) == 1 for g in groups)
        assert _cost(groups, lengths, overhead) == min(_cost(s, lengths, overhead) for s in _splits(lengths, budget))
        assert _cost(groups, lengths, overhead) <= _cost(token_budget_groups(lengths, budget), lengths, overhead)


def test_a_long_tailed_batch_pads_a_fifth_less_for_one_more_group():
    from benchmarks.trainer_profile import long_tail_batch

    batch = long_tail_batch(256, 60, 1000)
    last = torch.where(batch.loss_mask, torch.arange(batch.loss_mask.shape[1]), -1).max(dim=1).values
    lengths = (last + 1).tolist()
    greedy = token_budget_groups(lengths, 16_384)
    least = padded_groups(lengths, 16_384, 2048)
    assert len(greedy) == 3 and _cost(greedy, lengths, 0) == 47_481
    assert len(least) == 4 and _cost(least, lengths, 0) == 37_400  # 21% fewer padded positions
    assert len(padded_groups(lengths, 16_384, 10**9)) == 3  # an overhead that dominates: the fewest groups
