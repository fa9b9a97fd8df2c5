"""FP8 runs (`ModelSpec.fp8`): the validator recomputes with the same block-scaled e4m3 weights the
inference nodes serve (`apply_fp8_mode`, CPU reference GEMM here) and judges with the FP8 thresholds.
Honest FP8 rollouts pass; edited tokens, a relabelled version and 1% weight noise in one layer fail;
a rollout served at another precision than the run's (plain in an FP8 run, FP8 in a plain run) fails
the recomputation checks like any other engine that computes other numbers."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import rollouts as R  # noqa: E402

from node.engine.fp8.model import FP8GroupedExperts, FP8Linear, apply_fp8_mode, fp8_mode_of  # noqa: E402
from verification.calibration.perturb import perturb  # noqa: E402
from verification.checks import THRESHOLDS, Reason  # noqa: E402
from verification.validator import verify_claims  # noqa: E402

SEEDS = list(range(16))
RECOMPUTED = {Reason.HIDDEN_MISMATCH, Reason.LOGPROB_MISMATCH, Reason.SAMPLING_MISMATCH}


def fp8(model, mode: str):
    """What a node serves and a validator recomputes with: a quantised copy (the high-precision model stays)."""
    return apply_fp8_mode(copy.deepcopy(model), mode)


def layer0_noise(model, share: float = 0.01, seed: int = 3):
    """Weights of decoder layer 0 only x (1 + share N(0, 1)): a cheap cheat confined to one layer."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.startswith("model.layers.0.") and not name.endswith("norm.weight"):
                p.mul_(1 + share * torch.randn(p.shape, generator=g).to(p.dtype))
    return m


@pytest.fixture(scope="module", params=["experts", "all"])
def world(request):
    mode = request.param
    model = R.tiny_model()
    work = [(s, R.spec(s)) for s in SEEDS]
    ref = R.reference({0: fp8(model, mode)})
    honest = R.claims_from(R.generate(R.engine_for(fp8(model, mode), max_batch=8), work), work)
    return mode, model, work, ref, honest


def _all_rejected(claims, ref, reasons):
    verdicts = verify_claims(claims, ref)
    assert claims and all(not v.accepted for v in verdicts), [v.detail for v in verdicts if v.accepted]
    assert {v.reason for v in verdicts} <= reasons, {v.reason for v in verdicts}


def test_the_fp8_rule_is_one_and_the_reference_picks_its_fp8_thresholds(world):
    mode, model, _, ref, _ = world
    served = fp8(model, mode)
    assert fp8_mode_of(served) == mode and fp8_mode_of(model) == "off"
    assert any(isinstance(m, FP8GroupedExperts) for m in served.modules())
    assert any(isinstance(m, FP8Linear) for m in served.modules()) == (mode == "all")
    assert ref.precision == f"fp8-{mode}-float32" and ref.precision in THRESHOLDS
    assert R.reference({0: model}).precision == "float32"


def test_honest_fp8_rollouts_are_accepted(world):
    _, _, _, ref, honest = world
    verdicts = verify_claims(honest, ref)
    assert [v.reason for v in verdicts] == [Reason.OK] * len(honest), [v.detail for v in verdicts if not v.accepted]


def test_an_edited_token_is_rejected_at_fp8_tolerances(world):
    _, _, _, ref, honest = world
    cheat = []
    for c in honest:
        ids = list(c.token_ids)
        i = len(ids) // 2
        ids[i] = 3 + (ids[i] + 1) % (R.TOK.vocab_size - 3)
        if ids[i] != R.TOK.eos_id:
            cheat.append(c.model_copy(update={"token_ids": ids,
                                              "reward": R.env_oracle(R.TOK)[1](R.ENV, c.task_seed, ids)}))
    _all_rejected(cheat, ref, RECOMPUTED | {Reason.TERMINATION})


def test_a_relabelled_version_is_rejected_at_fp8_tolerances(world):
    mode, model, work, _, honest = world
    newer = perturb(model, "noise1pct", seed=7)  # one training step later
    ref = R.reference({0: fp8(model, mode), 1: fp8(newer, mode)})
    _all_rejected(R.relabel(honest, 1), ref, RECOMPUTED)


def test_one_percent_weight_noise_in_one_layer_is_rejected_at_fp8_tolerances(world):
    mode, model, work, ref, _ = world
    cheat = R.claims_from(R.generate(R.engine_for(fp8(layer0_noise(model), mode), max_batch=8), work), work)
    _all_rejected(cheat, ref, RECOMPUTED)


def test_a_plain_rollout_in_an_fp8_run_and_an_fp8_rollout_in_a_plain_run_are_rejected(world):
    mode, model, work, ref, honest = world
    plain = R.claims_from(R.generate(R.engine_for(copy.deepcopy(model), max_batch=8), work), work)
    _all_rejected(plain, ref, RECOMPUTED)
    assert all(v.accepted for v in verify_claims(plain, R.reference({0: model})))  # honest in a plain run
    _all_rejected(honest, R.reference({0: model}), RECOMPUTED)


def test_a_new_version_loaded_mid_rollout_is_quantised_on_arrival_and_checked_per_segment():
    model = R.tiny_model()
    newer = perturb(model, "noise1pct", seed=7)
    ref = R.reference({0: fp8(model, "experts"), 1: fp8(newer, "experts")})
    engine = R.engine_for(fp8(model, "experts"), max_batch=8)
    work = [(s, R.spec(s)) for s in SEEDS[:8]]
    for s, sp in work:
        engine.add_request(R.request(s, sp))
    done = []
    for _ in range(10):
        done += engine.step()
    engine.load_weights({k: v.clone() for k, v in newer.state_dict().items()}, version=1)  # high precision, as fetched
    while engine.has_work():
        done += engine.step()
    done.sort(key=lambda c: int(c.request_id[1:]))
    claims = R.claims_from(done, work)
    assert sum(len(set(c.versions)) == 2 for c in claims) >= 4
    assert all(v.accepted for v in verify_claims(claims, ref)), [v.detail for v in verify_claims(claims, ref)]
    # had the load not reached the FP8 buffers, version 1's segments would be version 0's numbers
    _all_rejected(R.relabel([c for c in claims if 1 in c.versions], 0), R.reference({0: fp8(model, "experts")}),
                  RECOMPUTED)


def test_every_precision_a_reference_can_name_has_thresholds_for_every_check():
    from verification.routing import HONEST_PAIR_RATE, ROUTER_TIE

    names = {"float32", "bfloat16"} | {f"fp8-{m}-{d}" for m in ("experts", "all") for d in ("float32", "bfloat16")}
    assert set(THRESHOLDS) == set(ROUTER_TIE) == set(HONEST_PAIR_RATE) == names
