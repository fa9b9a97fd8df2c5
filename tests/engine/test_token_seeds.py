"""The validator's per-segment seed derivation is the engine's per-token rule, value for value."""

import random

import numpy as np

from node.engine.device_sampling import seed_row
from node.engine.sampling import token_seed, token_seeds


def test_seeds_of_many_positions_are_each_positions_token_seed():
    rng = random.Random(0)
    for _ in range(200):
        seed = rng.choice([0, 1, rng.randrange(1 << 31), rng.randrange(1 << 63)])
        positions = [rng.randrange(1 << rng.choice([4, 16, 40])) for _ in range(rng.randrange(0, 50))]
        assert token_seeds(seed, positions) == [token_seed(seed, p) for p in positions]
    assert token_seeds(7, np.arange(3, 9)) == [token_seed(7, p) for p in range(3, 9)]  # numpy integers too
    assert seed_row(11, 5, 40).tolist() == [token_seed(11, p) for p in range(5, 45)]
