"""The validator's checks where its logits are: seeded-sampling replay on the device matches the
host rule, and a GPU validator reaches the same verdicts as a CPU one on the same claims (honest
accepted, tampered rejected). The GPU half runs on a CUDA machine (the H200 run's log is committed
under benchmarks/results/logs/); on the CPU it skips."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import rollouts as R  # noqa: E402

from node.engine.sampling import SamplingParams, sample  # noqa: E402
from node.replay import TorchReference, replay_on_device  # noqa: E402
from verification.claim import SamplingSpec  # noqa: E402
from verification.validator import verify_claims  # noqa: E402


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_replay_where_the_logits_are_makes_the_host_rules_decisions(temperature, top_p):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 1000, generator=g) * 3
    spec = SamplingSpec(temperature=temperature, top_p=top_p, max_new_tokens=64, seed=12345)
    positions = list(range(10, 74))
    host = sample(logits, [SamplingParams(temperature=temperature, top_p=top_p, seed=12345)] * 64, positions)
    ours = replay_on_device(logits, spec, positions)
    clear = host.margins > 1e-4  # where numerical noise cannot decide the draw
    assert clear.sum() > 50
    assert torch.equal(ours.tokens[clear], host.tokens[clear])
    assert torch.allclose(ours.logprobs, host.logprobs, atol=1e-5)
    assert torch.allclose(ours.margins[clear], host.margins[clear], atol=1e-4)


def _claims(model, n: int = 24):
    work = [(7000 + i, R.spec(7000 + i, temperature=(1.0, 0.7, 0.0)[i % 3], top_p=(1.0, 0.9, 1.0)[i % 3],
                              max_new_tokens=20 + i)) for i in range(n)]
    return R.claims_from(R.generate(R.engine_for(model, max_batch=8), work), work)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_validator_judges_cpu_rollouts_as_the_cpu_validator_does():
    model = R.tiny_model()
    claims = _claims(model)
    tampered = claims[3].model_copy(update={"token_ids": [(claims[3].token_ids[0] + 1) % R.TOK.vocab_size]
                                            + list(claims[3].token_ids[1:])})
    cpu_ref = R.reference({0: model})
    gpu_model = R.tiny_model().to("cuda")
    gpu_ref = TorchReference({0: (gpu_model, R.manifest(0))}, eos_id=cpu_ref.eos_id, max_seq_len=R.MAX_SEQ,
                             decode=R.TOK.decode, tasks=cpu_ref._tasks, reward=cpu_ref._reward)
    assert gpu_ref.on_device and gpu_ref.logits_bytes >= 256 << 20 and cpu_ref.logits_bytes is None
    for ref in (cpu_ref, gpu_ref):
        verdicts = verify_claims(claims + [tampered], ref)
        assert all(v.accepted for v in verdicts[:-1]), [v.detail for v in verdicts if not v.accepted]
        assert not verdicts[-1].accepted
