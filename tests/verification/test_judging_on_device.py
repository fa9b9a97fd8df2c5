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


def _measure_cases(device: str):
    """Rows of several segments (temperatures 1, 0.7 and greedy; top-p 1 and 0.9) with their claimed tokens."""
    g = torch.Generator().manual_seed(11)
    sizes, specs = [50, 90, 1, 70, 40], []  # 251 rows: chunks of 64 split segments
    for i in range(len(sizes)):
        specs.append(SamplingSpec(temperature=(1.0, 0.7, 0.0)[i % 3], top_p=(1.0, 0.9)[i % 2], max_new_tokens=64,
                                  seed=900 + i))
    logits = [(torch.randn(n, 500, generator=g) * 3).to(device) for n in sizes]
    positions = [list(range(20 + i, 20 + i + n)) for i, n in enumerate(sizes)]
    claimed = [torch.randint(0, 500, (n,), generator=g).tolist() for n in sizes]
    return logits, specs, positions, claimed


def _measure_matches_one_segment_at_a_time(ref: TorchReference, device: str) -> None:
    from verification.reference import Reference

    import node.replay as replay_mod

    logits, specs, positions, claimed = _measure_cases(device)
    alone = Reference.measure_tokens(ref, logits, specs, positions, claimed)  # the per-segment rule
    for scratch in (replay_mod.MEASURE_SCRATCH_FACTOR, 10**9):  # one chunk, and chunks of 64 rows (< one segment's rows)
        replay_mod.MEASURE_SCRATCH_FACTOR, saved = scratch, replay_mod.MEASURE_SCRATCH_FACTOR
        try:
            together = ref.measure_tokens(logits, specs, positions, claimed)
        finally:
            replay_mod.MEASURE_SCRATCH_FACTOR = saved
        assert len(together) == len(alone)
        for (lp_a, r_a), (lp_t, r_t) in zip(alone, together):
            assert lp_t.device.type == "cpu" and r_t.tokens.device.type == "cpu"
            assert torch.allclose(lp_t, lp_a, atol=1e-5)
            clear = r_a.margins > 1e-4
            assert torch.equal(r_t.tokens[clear], r_a.tokens[clear])
            assert torch.allclose(r_t.margins[clear], r_a.margins[clear], atol=1e-4)


def test_segments_measured_together_make_the_one_by_one_figures():
    _measure_matches_one_segment_at_a_time(R.reference({0: R.tiny_model()}), "cpu")


def test_row_chunks_split_and_join_segments_in_order():
    from node.replay import _row_chunks

    parts = [torch.arange(a, b)[:, None].float() for a, b in [(0, 5), (5, 6), (6, 20), (20, 23)]]
    for chunk in (1, 4, 7, 23, 100):
        got = list(_row_chunks(parts, chunk))
        assert [s for s, _ in got] == list(range(0, 23, chunk))
        assert torch.equal(torch.cat([x for _, x in got]).squeeze(-1), torch.arange(23).float())
        assert all(x.shape[0] <= chunk for _, x in got)


def test_claims_judged_together_get_the_verdicts_they_get_alone():
    """The batched measurement decides nothing by itself: honest claims and tampered ones (a fabricated
    logprob, an edited token, a hotter temperature) mixed in one round get, claim by claim, the verdict and
    evidence that judging each one alone gives."""
    from verification.checks import Reason

    model = R.tiny_model()
    ref = R.reference({0: model})
    claims = _claims(model, n=18)
    hot = [(7100 + i, R.spec(7100 + i, temperature=1.4)) for i in range(3)]
    tampered = [claims[1].model_copy(update={"logprobs": [lp - 0.5 for lp in claims[1].logprobs]}),
                claims[4].model_copy(update={"token_ids": [3 + (claims[4].token_ids[0] - 2) % (R.TOK.vocab_size - 4)]
                                             + list(claims[4].token_ids[1:])})]
    tampered += [c.model_copy(update={"sampling": R.spec(c.task_seed)})
                 for c in R.claims_from(R.generate(R.engine_for(model), hot), hot)]
    mixed = claims + tampered
    mixed = [c.model_copy(update={"work_id": 50_000 + i}) for i, c in enumerate(mixed)]  # one claim a submission
    ev_together: list = []
    together = verify_claims(mixed, ref, evidence=ev_together)
    alone, ev_alone = [], []
    for c in mixed:
        ev: list = []
        alone += verify_claims([c], ref, evidence=ev)
        ev_alone += ev
    assert [(v.accepted, v.reason, v.token) for v in together] == [(v.accepted, v.reason, v.token) for v in alone]
    assert all(v.accepted for v in together[: len(claims)])
    assert sum(not v.accepted for v in together[len(claims):]) >= 3 and together[len(claims)].reason == Reason.LOGPROB_MISMATCH
    for a, b in zip(ev_together, ev_alone):
        assert (a.chunks, a.exp_mismatches, a.tokens) == (b.chunks, b.exp_mismatches, b.tokens)
        assert abs(a.logprob_err - b.logprob_err) < 1e-5 and abs(a.mant_err - b.mant_err) < 1e-9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_segments_measured_together_on_the_gpu_make_the_host_figures():
    model = R.tiny_model().to("cuda")
    cpu_ref = R.reference({0: R.tiny_model()})
    gpu_ref = TorchReference({0: (model, R.manifest(0))}, eos_id=cpu_ref.eos_id, max_seq_len=R.MAX_SEQ,
                             decode=R.TOK.decode, tasks=cpu_ref._tasks, reward=cpu_ref._reward)
    _measure_matches_one_segment_at_a_time(gpu_ref, "cuda")
