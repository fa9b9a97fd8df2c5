"""False bans: honest rollouts judged by the validator's checks and the coordinator's ban policy,
under varied engine settings and CPU contention, with cheaters mixed in that must still be caught.

    python -m benchmarks.false_bans [--rollouts 100000] [--minutes 55] [--hogs 2]
        [--checkpoint /tmp/fb.jsonl] [--out benchmarks/results/false_bans-100k-cpu-2core.json]
    python -m benchmarks.false_bans --report /tmp/fb.jsonl [--out ...]   # figures of a cut run

Run it with OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1: on a busy 2-core machine OpenMP's spinning
threads made 2-thread generation 10-30x slower (float32 batch 64: 22 against 168 rollouts/s passive),
which changes no number a rollout holds, only how many rounds fit in the time.

Tiny MoE model (tests/verification/rollouts.py), CPU, the reverse task's short completions. Each
round one identity generates a batch of rollouts (fresh tasks and sampling seeds, temperature 1)
through the real `Engine` (hidden states and routed experts captured, proofs built by
`verification.proof.prove_rollouts`) with a randomly drawn engine batch size (`--batches`), thread
count (1, 2), precision (float32, bfloat16) and policy version (0, 1: two published versions whose
weights differ by 1% of each tensor's std); every rollout goes through `verify_claims` (the
validator role's call) against the honest weights of both versions, and its verdict through the
coordinator's real judging (`protocol.judging.record_verdicts` on a real `Coordinator` in a SQLite
file, the round's submissions group-committed by `submit_many`: a proof-grade failure bans, three
borderline ones ban, 200 valid verdicts forgive one). `HONEST_IDENTITIES` honest identities take
turns; every `--cheat-every`-th round is a fresh cheater identity submitting `--cheat-units` units of `--group`
rollouts, alternately `noise` (an engine with weight noise of 1% of each tensor's std on every
layer) and `relabel` (version 0's tokens and proofs claimed as version 1). `--hogs` busy-looping
processes run beside it the whole time (CPU contention). Every round is appended to `--checkpoint`
(JSONL), so a cut run still reports what it measured (`--report`). This is not the network chaos
of `benchmarks.chaos` (kills, partitions): a verdict depends on the rollout's numbers, which chaos
does not change, and on the engine settings and thread scheduling, which this varies. Prints
progress, then one JSON line; the peer in the same run is the cheaters' detection rate.

`--device cuda` (issue 26; `bash benchmarks/xdevice_h200.sh` on an H200): the node's GPU path on both sides.
Each precision (`--precisions`, default bf16, FP8 experts and FP8 all on a bf16 base) has one `CudaEngine`
(`builtin-cuda`, benchmarks/device_rollouts.py: a CUDA graph per batch bucket up to the largest
`--batches`, captured before the first round; FP8 quantised on the GPU as the node serves it) that serves
the whole run; a round submits `batch` requests to it (the decode batch), and a round of the other version
first copies that version in with `load_weights`, as a fetched version lands between two steps. The
verdicts come from the validator role's GPU path (`TorchReference` with its models on the GPU, every check
there). `--shape` (device_rollouts.SHAPES) picks the random model: default on CUDA `qwen3-moe-small` (the
0.5B network run's widths: hidden 1024, 8 layers, 32 experts top-4, 424M parameters with the 88-token
vocabulary; at hidden 128 the proofs' top-128 would cover every entry of a hidden state). The JSON adds
the device, torch, CUDA, Triton, kernels and matmul settings (`provenance`) and the rollouts per version.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
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

from benchmarks import device_rollouts as D
from benchmarks.weak_tamper import R
from protocol import judging
from protocol.coordinator import Coordinator
from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.messages import Join, RolloutGroup, RolloutSubmission, RunSpec, Verdict
from verification.pooled import POOLED_DETAIL
from verification.validator import verify_claims

log = logging.getLogger("bench.false_bans")

HONEST_IDENTITIES = 8
CHEAT_UNITS = 4
"""Work units a cheater identity submits in its round: borderline failures ban at `STRIKES_TO_BAN` (3)."""
CHEAT_NOISE = 1e-2
"""The `noise` cheater's weight noise, as a share of each tensor's std (all layers)."""
VERSION_STEP = 1e-2
"""Version 1 is version 0 plus noise of this share of each tensor's std (a policy update's size)."""
VERIFY_THREADS = 1
"""Torch threads of the verification (the engine's are drawn per round)."""


def _hog(stop_at: float) -> None:
    while time.time() < stop_at:
        sum(i * i for i in range(10_000))


def _submit(c: Coordinator, key: NodeKey, version: int, n: int, now: float) -> list[int]:
    """`n` work units leased to and submitted by `key`, group-committed (the rollout bytes live with
    the benchmark: the coordinator's judging needs the unit, not its tokens)."""
    items = []
    for _ in range(n):
        g = c.grant_lease(key.peer_id, now)
        body = RolloutGroup(work_id=g.work_id, rollouts=[RolloutSubmission(
            work_id=g.work_id, version_runs=[(version, 1)], token_ids=[4], logprobs=[-0.1], reward=0.0,
            finish_reason="eos") for _ in range(c.spec.group_size)])
        items.append((key.peer_id, body, seal(key, c.spec.run_id, body, now=now)))
    for r in c.submit_many(items, now):
        if not getattr(r, "accepted", False):
            raise RuntimeError(f"submission refused: {r!r}")
    return [b.work_id for _, b, _ in items]


def _write_evidence(path: Path, claims: list, verdicts: list, evidence: list, tags: dict) -> None:
    """Each claim's evidence as a JSON line (benchmarks.pooled_calibration reads them)."""
    with open(path, "a") as f:
        for c, v, e in zip(claims, verdicts, evidence):
            f.write(json.dumps({**tags, "work_id": c.work_id, "tokens_claimed": len(c.token_ids),
                                "passed_alone": v.accepted or v.detail.startswith(POOLED_DETAIL), **vars(e)}) + "\n")


def _unit_verdict(work_id: int, key: NodeKey, claims: list) -> Verdict:
    """A unit's verdict from its claims' (as the validator role forms it): invalid if any claim failed,
    proof-grade if any failure is."""
    bad = [v for v in claims if not v.accepted]
    worst = next((v for v in bad if v.severity.value != "borderline"), bad[0] if bad else None)
    return Verdict(work_id=work_id, submitter=key.peer_id, valid=worst is None,
                   reason="" if worst is None else worst.reason.value[:200],
                   severity="borderline" if worst is not None and worst.severity.value == "borderline" else "proof")


def upper_95(k: int, n: int) -> float | None:
    """One-sided 95% upper bound on a binomial rate after k events in n trials (Clopper-Pearson;
    for k = 0 this is 1 - 0.05^(1/n), about 3/n)."""
    if n == 0:
        return None
    if k >= n:
        return 1.0

    def cdf(p: float) -> float:
        return sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
                            + (i * math.log(p) if i else 0.0) + (n - i) * math.log1p(-p)) for i in range(k + 1))

    lo, hi = k / n, 1.0
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) > 0.05 else (lo, mid)
    return hi


def summarize(rounds: list[dict], honest_ids: int = HONEST_IDENTITIES) -> dict:
    """The figures of a run (or of the rounds a cut run checkpointed)."""
    c: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    settings: Counter[str] = Counter()
    versions: Counter[str] = Counter()
    banned_honest: set[str] = set()
    cheaters: dict[str, set[str]] = {"noise": set(), "relabel": set()}
    banned_cheaters: dict[str, set[str]] = {"noise": set(), "relabel": set()}
    for r in rounds:
        who = r["who"]
        c[f"{who}_rollouts"] += r["n"]
        c[f"{who}_after_ban"] += r.get("after_ban", 0)
        c[f"{who}_rejected"] += r["rejected"]
        for k, v in r["reasons"].items():
            reasons[f"{who}/{k}"] += v
        if who == "honest":
            settings[f"{r['precision']}/batch{r['batch']}/threads{r['threads']}"] += r["n"] - r.get("after_ban", 0)
            versions[f"v{r.get('version', 0)}"] += r["n"] - r.get("after_ban", 0)
            banned_honest |= set(r["banned"])
        else:
            c[f"{who}_{r['kind']}_rollouts"] += r["n"]
            c[f"{who}_{r['kind']}_rejected"] += r["rejected"]
            cheaters[r["kind"]].add(r["identity"])
            banned_cheaters[r["kind"]] |= set(r["banned"]) & {r["identity"]}
    judged = c["honest_rollouts"] - c["honest_after_ban"]
    loads = [r["load1"] for r in rounds]
    return {
        "rounds": len(rounds),
        "seconds": round(rounds[-1]["t"], 1) if rounds else 0.0,
        "honest_rollouts_judged": judged,
        "honest_rollouts_rejected": c["honest_rejected"],
        "honest_identities_banned": len(banned_honest),
        "honest_identities": honest_ids,
        "false_rejection_rate_upper_95": round(upper_95(c["honest_rejected"], judged), 8) if judged else None,
        "honest_rollouts_per_s": round(judged / rounds[-1]["t"], 2) if rounds else 0.0,
        "cheater_identities": {k: len(v) for k, v in cheaters.items()},
        "cheaters_banned": {k: len(v) for k, v in banned_cheaters.items()},
        "cheater_rollouts_judged": {k: c[f"cheater_{k}_rollouts"] for k in cheaters},
        "cheater_rollouts_rejected": {k: c[f"cheater_{k}_rejected"] for k in cheaters},
        "cheater_rejection_rate": {k: round(c[f"cheater_{k}_rejected"] / c[f"cheater_{k}_rollouts"], 4)
                                   for k in cheaters if c[f"cheater_{k}_rollouts"]},
        "load_avg_1m": {"mean": round(sum(loads) / len(loads), 2), "min": min(loads), "max": max(loads)}
        if loads else None,
        "rejections_by_reason": dict(reasons), "honest_rollouts_by_setting": dict(sorted(settings.items())),
        "honest_rollouts_by_version": dict(sorted(versions.items())),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=100_000, help="stop after this many honest rollouts judged")
    ap.add_argument("--minutes", type=float, default=55.0, help="stop after this long in any case")
    ap.add_argument("--hogs", type=int, default=None, help="busy-looping processes beside the run (default: 2 on "
                    "the CPU, 0 with --device cuda)")
    ap.add_argument("--batches", default="16,64,128,256", help="engine batch sizes drawn per round")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:i: where the engines serve and the validator "
                    "judges")
    ap.add_argument("--engine", choices=["builtin", "builtin-cuda"], default=None,
                    help="the inference role's engine (default: builtin-cuda on CUDA, builtin on the CPU)")
    ap.add_argument("--precisions", default=None, help="precisions drawn per round (device_rollouts.PRECISIONS; "
                    "default float32,bfloat16 on the CPU, bfloat16,fp8-experts-bfloat16,fp8-all-bfloat16 on CUDA)")
    ap.add_argument("--shape", default=None, choices=list(D.SHAPES), help="random model of this shape (device_rollouts.SHAPES; default: "
                    "the test harness's tiny model on the CPU, qwen3-moe-small on CUDA)")
    ap.add_argument("--round-rollouts", type=int, default=64,
                    help="an honest round's rollouts with the CPU engine: max(this, batch) (served engines: batch)")
    ap.add_argument("--group", type=int, default=8, help="rollouts per work unit (the run's group size): a unit's "
                    "claims are one submission, judged together (verification.pooled)")
    ap.add_argument("--cheat-units", type=int, default=CHEAT_UNITS, help="work units a cheater submits in its round")
    ap.add_argument("--evidence", type=Path, help="append each claim's evidence here (JSON lines)")
    ap.add_argument("--cheat-every", type=int, default=20, help="one round in this many is a cheater's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", type=Path, help="append every round here (JSONL)")
    ap.add_argument("--report", type=Path, help="only summarize this checkpoint file")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.hogs = args.hogs if args.hogs is not None else (0 if cuda else 2)
    args.precisions = args.precisions or ("bfloat16,fp8-experts-bfloat16,fp8-all-bfloat16" if cuda
                                          else "float32,bfloat16")
    args.shape = args.shape or ("qwen3-moe-small" if cuda else None)
    args.engine = args.engine or D.default_engine(args.device)
    if unknown := [p for p in args.precisions.split(",") if p and p not in D.PRECISIONS]:
        ap.error(f"unknown precisions {unknown}; known: {', '.join(D.PRECISIONS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("protocol").setLevel(logging.ERROR)
    if args.report:
        lines = [json.loads(x) for x in args.report.read_text().splitlines() if x.strip()]
        head, rounds = lines[0], lines[1:]
        result = {**head, **summarize(rounds), "cut": True}
    else:
        result = run(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    batches = [int(b) for b in args.batches.split(",")]
    precisions = [p for p in args.precisions.split(",") if p]
    t0 = time.time()
    hogs = [multiprocessing.Process(target=_hog, args=(t0 + args.minutes * 60 + 30,), daemon=True)
            for _ in range(args.hogs)]
    for h in hogs:
        h.start()
    head = {"bench": "false_bans", "machine": platform.node(), "torch": torch.__version__,
            "command": "python -m benchmarks.false_bans " + " ".join(sys.argv[1:]), "cpu_hogs": args.hogs,
            "cpus": os.cpu_count(), "verify_threads": VERIFY_THREADS, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                              time.gmtime(t0)),
            "device": args.device, "engine": args.engine, "precisions": precisions,
            "shape": D.shape_facts(args.shape or "tiny"), "provenance": D.provenance(args.device)}
    ckpt = args.checkpoint.open("w") if args.checkpoint else None
    if ckpt:
        ckpt.write(json.dumps(head) + "\n")
        ckpt.flush()
    models, fp8 = {}, {}
    for p in precisions:
        dtype, fp8[p] = D.PRECISIONS[p]
        v0 = R.tiny_model(dtype=dtype) if args.shape is None else D.random_model(args.shape, dtype, args.device)
        models[p] = {0: v0, 1: D.noisy(v0, VERSION_STEP, "all", seed=7)}
    refs = {p: D.judge_reference(m, fp8[p], args.device) for p, m in models.items()}
    noisy = {p: D.noisy(m[0], CHEAT_NOISE, "all") for p, m in models.items()}
    fresh = args.engine == "builtin"
    """The CPU engine is built per round at the round's batch and thread count; the others serve the run."""
    served = None if fresh else D.ServedEngines(args.engine, args.device, max(batches))

    def roll(precision: str, weights: str, version: int, work: list, batch: int, threads: int) -> list:
        model = noisy[precision] if weights == "noise" else models[precision][version]
        if fresh:
            eng = D.build_engine(model, fp8[precision], args.device, batch, args.engine, version, threads)
        else:
            eng = served.serving(precision, weights, version, model)
        claims = D.claims_of(eng, work, model.config)
        torch.set_num_threads(2)
        return claims

    ck = NodeKey.generate()
    honest = [NodeKey.generate() for _ in range(HONEST_IDENTITIES)]
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="false-bans-") as tmp:
        spec = RunSpec(run_id="false-bans", coordinator=ck.peer_id, max_off_policy_steps=1,
                       heartbeat_interval_s=3600, lease_ttl_s=86_400, batch_groups=1, group_size=args.group)
        c = Coordinator(tmp, spec, synchronous="OFF", now=t0)
        c.probation_units = 0  # probation changes what is batched, not what is banned
        for key in honest:
            c.join(key.peer_id, Join(spec_hash=c.spec_hash, role="inference"), t0)
        c.advance_policy(0, "00" * 32, t0)
        c.advance_policy(1, "11" * 32, t0)
        seed, rnd, judged = 10_000, 0, 0
        while judged < args.rollouts and time.time() - t0 < args.minutes * 60:
            precision = rng.choice(precisions)
            batch, threads, version = rng.choice(batches), rng.choice((1, 2)), rng.choice((0, 1))
            threads = threads if fresh else torch.get_num_threads()
            cheat = rnd % args.cheat_every == args.cheat_every - 1
            kind = ("noise", "relabel")[(rnd // args.cheat_every) % 2] if cheat else None
            n = args.cheat_units * args.group if cheat else max(batch, args.round_rollouts) if fresh else batch
            work = [(s, R.spec(s)) for s in range(seed, seed + n)]
            seed += n
            if cheat:
                key = NodeKey.generate()
                c.join(key.peer_id, Join(spec_hash=c.spec_hash, role="inference"), time.time())
            else:
                key = honest[rnd % HONEST_IDENTITIES]
            rec = {"round": rnd, "who": "cheater" if cheat else "honest", "kind": kind, "identity": key.peer_id,
                   "precision": precision, "batch": batch, "threads": threads, "n": n, "after_ban": 0,
                   "rejected": 0, "reasons": {}, "banned": []}
            rnd += 1
            if key.peer_id in c.store.banned_peers():
                rec["after_ban"] = n  # a banned identity gets no more leases
            else:
                if kind == "noise":
                    version = 0
                    claims = roll(precision, "noise", 0, work, batch, threads)
                elif kind == "relabel":  # an old version's work, claimed as the newest
                    version = 1
                    claims = D.relabel(roll(precision, "honest", 0, work, batch, threads), 1,
                                       refs[precision].hidden_size)
                else:
                    claims = roll(precision, "honest", version, work, batch, threads)
                torch.set_num_threads(VERIFY_THREADS)
                units = -(-n // args.group)
                claims = [x.model_copy(update={"work_id": seed - n + j // args.group}) for j, x in enumerate(claims)]
                evidence: list = []
                verdicts = verify_claims(claims, refs[precision], evidence=evidence)  # a unit's claims together
                if args.evidence:
                    _write_evidence(args.evidence, claims, verdicts, evidence, {
                        "precision": precision, "case": kind or "honest", "shape": args.shape or "tiny",
                        "engine_device": args.device, "judge_device": args.device, "batch": batch})
                now = time.time()
                wids = _submit(c, key, version, units, now)
                rec["rejected"] = sum(not v.accepted for v in verdicts)
                rec["reasons"] = dict(Counter(f"{v.reason.value}/{v.severity.value}" for v in verdicts if not v.accepted))
                if rec["rejected"] and not cheat:
                    for v in verdicts:
                        if not v.accepted:
                            log.warning("honest rollout rejected (%s batch %d threads %d v%d): %s %s %s", precision,
                                        batch, threads, version, v.reason.value, v.severity.value, v.detail[:300])
                    rec["details"] = [v.detail[:300] for v in verdicts if not v.accepted]
                for peer, why in judging.record_verdicts(c, "validator", [
                        _unit_verdict(w, key, verdicts[u * args.group:(u + 1) * args.group])
                        for u, w in enumerate(wids)], now):
                    c.ban(peer, why, now)
                    rec["banned"].append(peer)
                    if not cheat:
                        log.warning("honest identity %s banned: %s", peer, why)
                if not cheat:
                    judged += n
            rec["version"], rec["t"], rec["load1"] = version, round(time.time() - t0, 2), round(os.getloadavg()[0], 2)
            rounds.append(rec)
            if ckpt:
                ckpt.write(json.dumps(rec) + "\n")
                ckpt.flush()
            if rnd % 20 == 0:
                s = summarize(rounds)
                log.info("%d rounds, %.0f s: honest %d judged (%.1f/s), %d rejected, %d banned; cheaters rejected %s "
                         "of %s, banned %s of %s; load %.1f", rnd, time.time() - t0, judged, s["honest_rollouts_per_s"],
                         s["honest_rollouts_rejected"], s["honest_identities_banned"], s["cheater_rollouts_rejected"],
                         s["cheater_rollouts_judged"], s["cheaters_banned"], s["cheater_identities"],
                         os.getloadavg()[0])
        c.close()
    if served is not None:
        served.close()
    for h in hogs:
        h.terminate()
    if ckpt:
        ckpt.close()
    return {**head, **summarize(rounds), "cut": judged < args.rollouts}


if __name__ == "__main__":
    sys.exit(main())
