"""Cross-device check: rollouts generated on another device (tests/fixtures/cross_device, written by
`python -m benchmarks.cross_device_fixture`; its provenance says where) judged on this CPU by the
validator role's path (`TorchReference` + `verify_claims`, the precision the fixture's dtype gives, the
thresholds in force). Every honest claim passes; a tampered copy of a claim, judged in the same round
as all the honest ones, is rejected while they still pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.cross_device_files import judge, read_fixture, reference
from verification.checks import THRESHOLDS, token_logprobs
from verification.claim import RolloutClaim
from verification.reasons import Reason

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "cross_device"

pytestmark = pytest.mark.slow  # one judging round of the fixture's ~340 claims: ~15 s of CPU


@pytest.fixture(scope="module")
def fx():
    return read_fixture(FIXTURE)


@pytest.fixture(scope="module")
def ref(fx):
    return reference(fx, "cpu")


def _longest(fx, case_prefix: str, temperature: float) -> int:
    """Index of the fixture's longest single-turn claim of a case family at `temperature`."""
    pick = [i for i, (case, c) in enumerate(zip(fx.cases, fx.claims))
            if case.startswith(case_prefix) and c.sampling.temperature == temperature and all(c.sampled_mask)]
    return max(pick, key=lambda i: len(fx.claims[i].token_ids))


def _other_token(fx, ref, claim: RolloutClaim, k: int) -> tuple[int, float]:
    """The most likely token at completion position k other than the claimed one and EOS, with the
    logprob the model gives it there (what a cheater substituting a token would claim)."""
    start = len(claim.prompt_ids) - 1
    logits, _ = ref.prefill(0, [claim.prompt_ids + claim.token_ids[:-1]], logits_from=[start])[0]
    row = logits[k].clone()
    row[[claim.token_ids[k], ref.eos_id]] = float("-inf")
    tok = int(row.argmax())
    return tok, float(token_logprobs(logits[k : k + 1], torch.tensor([tok]), claim.sampling.temperature))


def tampers(fx, ref) -> dict[str, tuple[int, RolloutClaim]]:
    """name -> (index of the honest claim it was made from, the tampered claim)."""
    out = {}
    i = _longest(fx, "echo/batch64", 1.0)
    c = fx.claims[i]
    k = len(c.token_ids) // 2
    tok, lp = _other_token(fx, ref, c, k)
    tokens = c.token_ids[:k] + [tok] + c.token_ids[k + 1:]
    # the reward is recomputed for the new text, so only the recomputation can tell
    out["one token changed, with its logprob"] = (i, c.model_copy(update={
        "token_ids": tokens, "logprobs": c.logprobs[:k] + [min(0.0, lp)] + c.logprobs[k + 1:],
        "reward": ref.reward(c.env, c.task_seed, tokens)}))
    j = next(j for j, d in enumerate(fx.claims) if j != i and d.proof != c.proof
             and d.sampled_mask == c.sampled_mask and d.versions == c.versions)
    out["the proof of another rollout"] = (i, c.model_copy(update={"proof": fx.claims[j].proof}))
    g = _longest(fx, "echo/batch8", 0.0)
    d = fx.claims[g]
    out["one logprob 1 nat off (greedy)"] = (g, d.model_copy(update={
        "logprobs": d.logprobs[:3] + [d.logprobs[3] - 1.0] + d.logprobs[4:]}))
    return out


@pytest.fixture(scope="module")
def judged(fx, ref):
    bad = tampers(fx, ref)
    verdicts = judge(fx, fx.claims + [c for _, c in bad.values()], ref=ref)
    return verdicts[: len(fx.claims)], dict(zip(bad, zip(bad.values(), verdicts[len(fx.claims):])))


def test_the_fixture_covers_the_engine_paths_it_claims(fx, ref):
    p = fx.provenance
    assert ref.precision == p["dtype"] == "bfloat16" and ref.precision in THRESHOLDS, p["dtype"]
    assert p["engine_batches"] == [1, 8, 64] and p["temperatures"] == [0.0, 1.0], fx.generated_on
    assert all(c.routed_experts is not None for c in fx.claims), f"routes missing ({fx.generated_on})"
    assert sum(not all(c.sampled_mask) for c in fx.claims) >= 10  # multi-turn, with tool tokens
    assert max(len(c.token_ids) for c in fx.claims) > 32  # rollouts of two proof chunks


def test_the_committed_fixture_was_generated_on_a_gpu_with_cuda_graphs(fx):
    # issue 26 item 2: CI judges GPU-generated rollouts on its CPU (regenerate with benchmarks/cross_device_device.sh)
    p = fx.provenance
    assert p["device"] == "cuda" and p["graphs"], fx.generated_on
    assert p["engine"] == "node.engine.cuda_engine.CudaEngine", fx.generated_on


def test_every_honest_rollout_from_the_other_device_is_accepted_on_the_cpu(fx, judged):
    honest, _ = judged
    rejected = [(case, v.reason.value, v.detail) for case, v in zip(fx.cases, honest) if not v.accepted]
    assert len(honest) == len(fx.claims) >= 300
    assert not rejected, (f"{len(rejected)} of {len(honest)} honest claims generated on {fx.generated_on} rejected "
                          f"on the CPU (torch {torch.__version__}): {rejected[:5]}")


def test_a_tampered_rollout_is_rejected_and_the_honest_round_still_passes(fx, judged):
    honest, bad = judged
    for name, ((i, _), v) in bad.items():
        assert not v.accepted, (f"{name} (from {fx.cases[i]}, generated on {fx.generated_on}) accepted on the CPU")
        assert v.reason in (Reason.SAMPLING_MISMATCH, Reason.HIDDEN_MISMATCH, Reason.LOGPROB_MISMATCH,
                            Reason.ROUTES_MISMATCH), (name, v.reason, v.detail)
        assert honest[i].accepted, f"the honest original of {name} ({fx.cases[i]}) rejected: {honest[i].detail}"
    assert sum(v.accepted for v in honest) == len(honest), f"generated on {fx.generated_on}"


def _shifted(claim: RolloutClaim, delta: float, work_id: int) -> RolloutClaim:
    """Every sampled token's claimed logprob `delta` nats higher: a drift no single token or rollout shows."""
    lp = [x + delta if s else x for x, s in zip(claim.logprobs, claim.sampled_mask)]
    return claim.model_copy(update={"logprobs": lp, "work_id": work_id})


def test_a_submission_of_small_drift_passes_rollout_by_rollout_and_fails_pooled(fx, ref):
    # 8 single-turn rollouts of >= 32 tokens, one submission (a shared work id), as a work unit is judged
    members = [c for c in fx.claims if all(c.sampled_mask) and len(c.token_ids) >= 32][:8]
    assert len(members) == 8
    honest = [c.model_copy(update={"work_id": 900_001}) for c in members]
    drift = [_shifted(c, 0.015, 900_002) for c in members]
    alone = [_shifted(c, 0.015, 900_100 + i) for i, c in enumerate(members)]  # each its own submission
    verdicts = judge(fx, honest + drift + alone, ref=ref)
    assert all(v.accepted for v in verdicts[:8]), [v.detail for v in verdicts[:8] if not v.accepted]
    assert all(v.accepted for v in verdicts[16:]), [v.detail for v in verdicts[16:] if not v.accepted]
    pooled = verdicts[8:16]
    assert not any(v.accepted for v in pooled)
    assert {v.reason for v in pooled} == {Reason.LOGPROB_MISMATCH} and pooled[0].detail.startswith("pooled over 8")


def test_the_validator_judges_a_served_shape_by_its_own_pooled_bounds_where_it_has_them(fx, ref, monkeypatch):
    from verification import pooled

    members = [c.model_copy(update={"work_id": 900_003}) for c in fx.claims
               if all(c.sampled_mask) and len(c.token_ids) >= 32][:8]
    assert ref.shape == pooled.shape_of(ref.config) and ref.shape not in pooled.POOLED_BY_SHAPE
    assert all(v.accepted for v in judge(fx, members, ref=ref))
    # bounds of this shape's own that no measured figure meets: the same honest submission now fails pooled
    none_fit = pooled.PooledThresholds(*(pooled.PooledBound(1e-9, 0.0) for _ in range(3)))
    monkeypatch.setitem(pooled.POOLED_BY_SHAPE, ref.shape, {ref.precision: none_fit})
    verdicts = judge(fx, members, ref=ref)
    assert not any(v.accepted for v in verdicts) and verdicts[0].detail.startswith("pooled over 8")
