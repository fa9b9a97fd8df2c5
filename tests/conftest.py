"""What every test shares: one torch thread, the GPU skip, the run order (fast tests first, so a broken
change fails in the first minutes), and the real SmolLM2 checkpoint loaded once per run."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests' shared helpers (cli_runs) under importlib mode

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    # Triton's own helpers (`tl.zeros`, ...) are decorated when `triton` is first imported, for its interpreter only if
    # TRITON_INTERPRET was set then: a CPU test that imports Triton first (the FP8 modules) left helpers that the
    # interpreter tests (tests/triton_on.py) cannot call. Imported here under it; no CPU test compiles a kernel.
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language  # noqa: F401
    del os.environ["TRITON_INTERPRET"]

# Tests share 2 cores with each other's processes; one thread keeps timings stable.
torch.set_num_threads(int(os.environ.get("PRIMERL_TEST_THREADS", "1")))


def expected_s(item) -> float:
    """A slow test's `slow(seconds=N)`: about how long it took beside a CPU hog (0 where unsaid)."""
    slow = item.get_closest_marker("slow")
    return slow.kwargs.get("seconds", 0) if slow else 0


def pytest_collection_modifyitems(config, items):
    # slow-marked tests last, the longest of them first: two workers end together when the last tests to
    # start are short ones (longest-processing-time-first); a 60 s test started last held one worker a minute
    # after the other had run out. The sort is stable, so each module's order (and its fixtures' reuse) stays
    items.sort(key=lambda item: (item.get_closest_marker("slow") is not None, -expected_s(item)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct through the model spec (node.model.spec.LoadedModel: model, tokenizer,
    directory), loaded once per run for every test that reads it (none may change its weights:
    tampering tests perturb a copy). Skips where the checkpoint cannot be had offline."""
    pretrained = pytest.importorskip("node.model.pretrained")
    from node.model.spec import ModelSpec, load_model

    try:
        pretrained.smollm2_dir()
    except pretrained.PretrainedUnavailable as exc:
        pytest.skip(str(exc))
    return load_model(ModelSpec(source="smollm2-135m-instruct", dtype="float32"))  # compared with transformers in float32
