"""The seeded sampler's Triton passes (`node.engine.sampling_kernels.sample_triton`, what `CudaEngine` samples with)
against the CPU rule (`node.engine.sampling.sample`), in Triton's interpreter on a CPU machine; on a GPU
`tests/engine/test_cuda_engine_gpu.py::test_device_sampler_matches_cpu_rule` runs the same comparison compiled."""

import importlib.util

import pytest
import torch

from node.engine.device_sampling import seed_row
from node.engine.sampling import SamplingParams, sample


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no Triton here")
def test_the_triton_sampler_picks_the_cpu_rules_tokens_in_the_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU-machine test: the GPU test compiles the same kernels")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from node.engine.sampling_kernels import sample_triton

    torch.manual_seed(0)
    for b, v in ((8, 300), (12, 9000)):  # one chunk, and several (the best chunk's best across chunks)
        logits = torch.randn(b, v) * 3
        params = [SamplingParams(temperature=[1.0, 0.6, 0.0, 1.5][i % 4], seed=i) for i in range(b)]
        pos = list(range(10, 10 + b))
        seeds = [int(seed_row(p.seed, q, 1)[0]) for p, q in zip(params, pos)]
        ref = sample(logits, params, pos)
        tok, lp, _ = sample_triton(logits, torch.tensor([p.temperature for p in params]), torch.tensor(seeds))
        assert torch.equal(tok, ref.tokens)
        assert (lp - ref.logprobs).abs().max() <= 2e-6 * max(1.0, float(ref.logprobs.abs().max()))
