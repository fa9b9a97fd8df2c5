"""Credit follows the work (issue 29, item 4): a work unit's sampling seeds are bound to the identity it
is leased to (`protocol.work.holder_seed`), so rollouts generated under one holder's lease, handed to
another identity that holds the re-granted lease and submits them as its own, fail the validator's
seeded sampling replay; the same rollouts pass for the holder that made them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import rollouts as R  # noqa: E402

from protocol.identity import NodeKey  # noqa: E402
from protocol.work import derive_work, holder_seed, sampling_seed  # noqa: E402
from verification.checks import Reason  # noqa: E402
from verification.validator import verify_claims  # noqa: E402

A = NodeKey.from_seed(b"a" * 32).peer_id
B = NodeKey.from_seed(b"b" * 32).peer_id


def test_rollouts_made_under_one_holders_lease_fail_when_another_identity_submits_them():
    model = R.tiny_model()
    ref = R.reference({0: model})
    work = []
    for work_id in range(12):
        task, seed = derive_work("credit-run", 0, work_id, 1000)
        work.append((task, R.spec(sampling_seed(holder_seed(seed, A), 0)), seed))
    made_by_a = R.claims_from(R.generate(R.engine_for(model), [(t, sp) for t, sp, _ in work]),
                              [(t, sp) for t, sp, _ in work])
    assert [v.reason for v in verify_claims(made_by_a, ref)] == [Reason.OK] * len(work)  # A's own: accepted
    as_b = [c.model_copy(update={"sampling": c.sampling.model_copy(
        update={"seed": sampling_seed(holder_seed(s, B), 0)})}) for c, (_, _, s) in zip(made_by_a, work)]
    verdicts = verify_claims(as_b, ref)
    # every rollout with at least one binding choice fails the replay (a near-tie may go either way)
    assert sum(not v.accepted for v in verdicts) >= len(work) - 1, [v.reason for v in verdicts]
    assert {v.reason for v in verdicts if not v.accepted} <= {Reason.SAMPLING_MISMATCH}
    assert holder_seed(work[0][2], A) != holder_seed(work[0][2], B)
