import os

import pytest
import torch

# Tests share 2 cores with each other's processes; one thread keeps timings stable.
torch.set_num_threads(int(os.environ.get("PRIMERL_TEST_THREADS", "1")))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
