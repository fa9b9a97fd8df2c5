"""False bans: honest rollouts judged by the validator's checks and the coordinator's ban policy,
under varied engine settings and CPU contention, with cheaters mixed in that must still be caught.

    python -m benchmarks.false_bans [--minutes 10] [--hogs 2] [--out benchmarks/results/false_bans-cpu-2core.json]

Tiny MoE model (tests/verification/rollouts.py), CPU. Each round one identity generates a batch of
rollouts (fresh tasks and sampling seeds, temperature 1) with a randomly drawn engine batch size
(1, 8, 32), thread count (1, 2) and precision (float32, bfloat16); every rollout goes through
`verify_claims` against the honest weights, and its verdict through the coordinator's real judging
(`protocol.judging.record_verdicts` on a real `Coordinator`: a proof-grade failure bans, three
borderline ones ban). `HONEST_IDENTITIES` honest identities take turns; every `CHEAT_EVERY`-th round
is a fresh cheater identity whose engine carries weight noise of 1% of each tensor's std on every
layer (caught on 99-100% of submissions in `benchmarks/results/weak_tamper-cpu-2core.json`).
`--hogs` busy-looping processes run beside it the whole time (CPU contention). This is not the
network chaos of `benchmarks.chaos` (kills, partitions), whose `honest_banned` is reported there: a
verdict depends on the rollout's numbers, which chaos does not change, and on the engine settings
and thread scheduling, which this varies. Prints progress, then one JSON line; the peer in the same
run is the cheaters' detection rate.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import platform
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.weak_tamper import R, claims_of, perturbed
from protocol import judging
from protocol.coordinator import Coordinator
from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.messages import Join, RolloutGroup, RolloutSubmission, RunSpec, Verdict
from verification.validator import verify_claims

log = logging.getLogger("bench.false_bans")

HONEST_IDENTITIES = 8
CHEAT_EVERY = 20
"""One round in this many is a cheater's."""
CHEAT_NOISE = 1e-2
"""The cheater's weight noise, as a share of each tensor's std (all layers)."""


def _hog(stop_at: float) -> None:
    while time.time() < stop_at:
        sum(i * i for i in range(10_000))


def _unit(c: Coordinator, key: NodeKey, now: float) -> int:
    """A work unit leased to and submitted by `key` (the rollout's bytes live with the benchmark)."""
    g = c.grant_lease(key.peer_id, now)
    sub = RolloutSubmission(work_id=g.work_id, version_runs=[(0, 1)], token_ids=[4], logprobs=[-0.1], reward=0.0,
                            finish_reason="eos")
    body = RolloutGroup(work_id=g.work_id, rollouts=[sub])
    c.submit(key.peer_id, body, seal(key, c.spec.run_id, body, now=now), now)
    return g.work_id


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long to run (bounded)")
    ap.add_argument("--hogs", type=int, default=2, help="busy-looping processes beside the run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("protocol").setLevel(logging.ERROR)
    rng = random.Random(args.seed)
    t0 = time.time()
    hogs = [multiprocessing.Process(target=_hog, args=(t0 + args.minutes * 60 + 30,), daemon=True)
            for _ in range(args.hogs)]
    for h in hogs:
        h.start()
    models = {p: R.tiny_model(dtype=d) for p, d in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    refs = {p: R.reference({0: m}) for p, m in models.items()}
    cheat_models = {p: perturbed(m, CHEAT_NOISE, "all") for p, m in models.items()}
    ck = NodeKey.generate()
    honest = [NodeKey.generate() for _ in range(HONEST_IDENTITIES)]
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    settings: Counter[str] = Counter()
    cheaters: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        spec = RunSpec(run_id="false-bans", coordinator=ck.peer_id, max_off_policy_steps=1,
                       heartbeat_interval_s=3600, lease_ttl_s=86_400, batch_groups=1)
        c = Coordinator(tmp, spec, synchronous="OFF", now=t0)
        c.probation_units = 0  # probation changes what is batched, not what is banned
        for key in honest:
            c.join(key.peer_id, Join(spec_hash=c.spec_hash, role="inference"), t0)
        c.advance_policy(0, "00" * 32, t0)
        seed, rnd = 10_000, 0
        while time.time() - t0 < args.minutes * 60:
            precision = rng.choice(("float32", "bfloat16"))
            batch, threads = rng.choice((1, 8, 32)), rng.choice((1, 2))
            n = max(batch, 8)
            work = [(s, R.spec(s)) for s in range(seed, seed + n)]
            seed += n
            cheat = rnd % CHEAT_EVERY == CHEAT_EVERY - 1
            if cheat:
                key = NodeKey.generate()
                c.join(key.peer_id, Join(spec_hash=c.spec_hash, role="inference"), time.time())
                cheaters.append(key.peer_id)
            else:
                key = honest[rnd % HONEST_IDENTITIES]
                settings[f"{precision}/batch{batch}/threads{threads}"] += n
            engine_model = cheat_models[precision] if cheat else models[precision]
            claims = claims_of(engine_model, models[precision], work, batch, threads)
            verdicts = verify_claims(claims, refs[precision])
            who = "cheater" if cheat else "honest"
            now = time.time()
            banned_now = c.store.banned_peers()
            for v in verdicts:
                counts[f"{who}_rollouts"] += 1
                if key.peer_id in banned_now:
                    counts[f"{who}_after_ban"] += 1
                    continue
                wid = _unit(c, key, now)
                counts[f"{who}_rejected"] += not v.accepted
                if not v.accepted:
                    reasons[f"{who}/{v.reason.value}/{v.severity.value}"] += 1
                    if not cheat:
                        log.info("honest rollout rejected (%s batch %d threads %d): %s", precision, batch, threads,
                                 v.detail[:300] if hasattr(v, "detail") else v)
                for peer, why in judging.record_verdicts(c, "validator", [Verdict(
                        work_id=wid, submitter=key.peer_id, valid=v.accepted, reason=v.reason.value[:200],
                        severity="borderline" if v.severity.value == "borderline" else "proof")], now):
                    c.ban(peer, why, now)
                    banned_now = c.store.banned_peers()
            rnd += 1
            if rnd % 10 == 0:
                log.info("%d rounds, %.0f s: %s; banned honest %d of %d, cheaters %d of %d", rnd, time.time() - t0,
                         dict(counts), len(banned_now & {k.peer_id for k in honest}), HONEST_IDENTITIES,
                         len(banned_now & set(cheaters)), len(cheaters))
        banned = c.store.banned_peers()
        c.close()
    for h in hogs:
        h.terminate()
    judged_honest = counts["honest_rollouts"] - counts["honest_after_ban"]
    result = {
        "bench": "false_bans", "machine": platform.node(), "torch": torch.__version__,
        "command": f"python -m benchmarks.false_bans --minutes {args.minutes:g} --hogs {args.hogs} --seed {args.seed}",
        "seconds": round(time.time() - t0, 1), "cpu_hogs": args.hogs, "load_avg_1m_end": round(os.getloadavg()[0], 2),
        "honest_rollouts_judged": judged_honest,
        "honest_rollouts_rejected": counts["honest_rejected"],
        "honest_identities_banned": len(banned & {k.peer_id for k in honest}),
        "honest_identities": HONEST_IDENTITIES,
        "false_rejection_rate_upper_95": round(3 / judged_honest, 7) if judged_honest and not counts["honest_rejected"]
        else None,
        "cheater_identities": len(cheaters), "cheaters_banned": len(banned & set(cheaters)),
        "cheater_rollouts_judged": counts["cheater_rollouts"] - counts["cheater_after_ban"],
        "cheater_rollouts_rejected": counts["cheater_rejected"],
        "rejections_by_reason": dict(reasons), "honest_rollouts_by_setting": dict(settings),
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
