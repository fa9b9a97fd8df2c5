"""Right padding and token-budget groups: what every batched prefill (engines, validator) builds on."""

import torch

from node.model.batching import right_pad, token_budget_groups


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
