"""Verifying a batch of rollout claims: cheap checks first, then one prefill per policy version.

Invariant: every claim gets exactly one verdict, and nothing a claim holds can raise out of
`verify_claims` (a bad claim is a `malformed` rejection, never a crash; one the validator ran out of
memory recomputing is `unjudged`, no evidence against its submitter). Claims that share a policy
version are prefilled together, and where that fails, in halves down to one claim, so a claim that
makes the reference fail fails alone; a rollout whose tokens came from several versions is checked
segment by segment, each against its own version. Claimed routed experts (router replay) are read
with the cheap checks and compared with the experts the same prefill routed to
(`verification.routing`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from protocol.errors import InvalidProof
from protocol.identity import NodeKey
from protocol.messages import BUILTIN_ONLY
from verification.checks import (Failure, Reason, Segment, Severity, check_segments, check_task, check_termination,
                                 turns)
from verification.claim import RolloutClaim
from verification.pooled import Evidence, check_pooled
from verification.proof import ChunkSpan, Commitment, VersionRun, chunk_spans, decode_rollout_proof
from verification.reference import Reference
from verification.routing import check_routes_many, route_positions
from verification.verdict import Verdict

log = logging.getLogger(__name__)


@dataclass
class _Plan:
    """Per claim: sampled token indices of each version, their chunk spans and commitments."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    spans: dict[int, list[ChunkSpan]] = field(default_factory=dict)
    commitments: dict[int, list[Commitment]] = field(default_factory=dict)
    chunk_offsets: dict[int, list[int]] = field(default_factory=dict)
    routes: torch.Tensor | None = None
    """The claimed routed experts [positions, moe_layers, k], decoded (None: none claimed)."""


def _plan(claim: RolloutClaim, ref: Reference) -> _Plan | Failure:
    if max(claim.prompt_ids + claim.token_ids) >= ref.vocab_size:
        return Failure(Reason.MALFORMED, f"token id outside the vocabulary of {ref.vocab_size}")
    if claim.sampled is None:  # every token sampled (single-turn)
        idx, versions = list(range(len(claim.token_ids))), claim.versions
    else:
        idx = [i for i, s in enumerate(claim.sampled) if s]
        versions = [claim.versions[i] for i in idx]
    try:
        runs = decode_rollout_proof(claim.proof, ref.hidden_size)
        commitments = Commitment.many_from_bytes([c for r in runs for c in r.chunks])
    except InvalidProof as exc:
        return Failure(Reason.MALFORMED, str(exc))
    spans = chunk_spans(versions)
    if not _runs_match(runs, versions) or len(commitments) != len(spans):
        return Failure(Reason.MALFORMED, "proof runs do not match the claimed per-token versions")
    for r in runs:
        known = ref.manifest_hash(r.version)
        if known is None or known != r.manifest_hash:
            return Failure(Reason.UNKNOWN_VERSION, f"version {r.version} with manifest hash "
                           f"{r.manifest_hash.hex()[:16]}.. is not a published policy")
    plan = _Plan()
    for n, (span, c) in enumerate(zip(spans, commitments)):
        rows = plan.tokens.setdefault(span.version, [])
        local = ChunkSpan(span.version, len(rows), len(rows) + span.end - span.start)
        rows.extend(idx[span.start : span.end])
        plan.spans.setdefault(span.version, []).append(local)
        plan.commitments.setdefault(span.version, []).append(c)
        plan.chunk_offsets.setdefault(span.version, []).append(n)
    if claim.routed_experts is not None:
        try:
            plan.routes = ref.decode_routes(claim.routed_experts, route_positions(claim))
        except ValueError as exc:  # node.model.routing.InvalidRoutes: wrong length, expert id out of range
            return Failure(Reason.ROUTES_MALFORMED, str(exc))
    return plan


def _runs_match(runs: list[VersionRun], versions: list[int]) -> bool:
    """The proof's version runs, token by token, are the claimed versions of the sampled tokens."""
    if len(runs) == 1:  # one version: counted, not spelled out token by token
        return runs[0].n_tokens == len(versions) and versions.count(runs[0].version) == len(versions)
    return [v for r in runs for v in [r.version] * r.n_tokens] == versions


def _segments(claim: RolloutClaim) -> list[tuple[int, int, int]]:
    """(version, start, end) over the prefill positions of prompt + completion[:-1]: the input at
    position p produced completion token p - (len(prompt) - 1); the prompt belongs to token 0's version."""
    base = len(claim.prompt_ids) - 1
    total = base + len(claim.token_ids)
    out: list[tuple[int, int, int]] = []
    for p in range(total):
        v = claim.versions[max(0, p - base)]
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1], p + 1)
        else:
            out.append((v, p, p + 1))
    return out


MAX_TURN_PASSES = 16
"""Most turns of one claim recomputed each with its own prefill of the history (`_turn_passes`): the cost
grows with turns x length, so a claim of hundreds of one-token turns across a version change is refused
(a strike, not a ban: an honest env may play long games) rather than recomputed quadratically."""


def _turn_passes(claim: RolloutClaim) -> list[tuple[list[tuple[int, int, int]], int, int, int]] | None:
    """The engine's passes of a multi-turn claim whose policy changed between its turns, one per turn:
    (segments, first, end, fresh). A turn is a new request: its whole history (prompt, earlier turns,
    tool reply) was prefilled under the version of the turn's first token, then each later token
    decoded under its own; `first`..`end` are the turn's sampled tokens, `fresh` the first position no
    earlier pass computed (the positions before it were routed afresh by this prefill, not replayed).
    None when one pass over the sequence (`_segments`) is the same computation: no turn's history
    carries a version other than the one that prefilled it."""
    base = len(claim.prompt_ids) - 1
    label = [claim.versions[max(0, q - base)] for q in range(base + len(claim.token_ids))]
    passes, fresh, differs = [], 0, False
    for first, end in turns(claim):
        v = claim.versions[first]
        differs |= any(x != v for x in label[: base + first + 1])
        segments = [(v, 0, fresh), (v, fresh, base + first + 1)] if fresh else [(v, 0, base + first + 1)]
        for q in range(base + first + 1, base + end):
            if segments[-1][0] == label[q] and segments[-1][2] == q:
                segments[-1] = (label[q], segments[-1][1], q + 1)
            else:
                segments.append((label[q], q, q + 1))
        passes.append((segments, first, end, fresh))
        fresh = base + end
    return passes if differs else None


def _recompute_turns(claim: RolloutClaim, p: _Plan, ref: Reference, passes) -> tuple:
    """`prefill_mixed`'s result for a claim recomputed pass by pass as its engine ran it (`_turn_passes`):
    each sampled token's logits and hidden state from its turn's pass, each position's routes from the
    first pass that computed it (the claimed routes' rule, `node.model.routing.rollout_routes`)."""
    base, seq = len(claim.prompt_ids) - 1, claim.prompt_ids + claim.token_ids[:-1]
    logits = hidden = routes = router = None
    with_routes = p.routes is not None
    for segments, first, end, fresh in passes:
        out = ref.prefill_mixed(seq[: base + end], segments, with_routes=with_routes, with_router_logits=with_routes,
                                logits_from=base + first, replay=p.routes, free_before=fresh)
        lg, hd = out[0], out[1]
        if logits is None:
            logits = lg.new_zeros((len(claim.token_ids), lg.shape[-1]))
            hidden = hd.new_zeros((len(seq), hd.shape[-1]))
        logits[first:end] = lg
        hidden[base + first : base + end] = hd[base + first : base + end]
        if with_routes and out[2] is not None:
            routes = out[2].new_zeros((len(seq), *out[2].shape[1:])) if routes is None else routes
            routes[fresh : base + end] = out[2][fresh : base + end]
            if len(out) > 3 and out[3] is not None:
                router = out[3].new_zeros((len(seq), *out[3].shape[1:])) if router is None else router
                router[fresh : base + end] = out[3][fresh : base + end]
    if p.routes is None:
        return logits, hidden
    return logits, hidden, routes, router


def _mixed_item(claim: RolloutClaim, p: _Plan) -> tuple:
    """(sequence, segments, logits_from, replay) of a mixed-version claim, as `Reference.prefill_mixed` takes them."""
    start = len(claim.prompt_ids) - 1  # the position that produced completion token 0
    return claim.prompt_ids + claim.token_ids[:-1], _segments(claim), start, p.routes


def _verify_mixed_group(members: list[int], claims: list[RolloutClaim], plans: list[_Plan | None],
                        failures: list[Failure | None], ref: Reference, evidence: list[Evidence]) -> None:
    """Mixed-version claims (all with routes or all without) recomputed together, version by version
    (`Reference.prefill_mixed_many`: a resident model switches once per version, not twice per claim, and
    forwards in batches), then each checked as `_verify_mixed` checks it; a claim that fails is recomputed
    alone and checked again, and only that verdict stands; should the shared recomputation fail, one by one."""
    routed = plans[members[0]].routes is not None
    turned = [i for i in members if _turn_passes(claims[i]) is not None]
    for i in turned:  # the policy changed between its turns: recomputed turn by turn, alone
        failures[i] = _verify_mixed(claims[i], plans[i], ref, evidence[i])
    members = [i for i in members if i not in turned]
    if not members:
        return
    try:
        outs = ref.prefill_mixed_many([_mixed_item(claims[i], plans[i]) for i in members], with_routes=routed,
                                      with_router_logits=routed)
    except Exception as exc:
        _halves_after(exc, "recomputing mixed-version claims", members, claims, failures,
                      lambda half: _verify_mixed_group(half, claims, plans, failures, ref, evidence))
        return
    evs = [Evidence() for _ in members]
    try:  # every member's segments measured together, its routes checked together
        checked = _mixed_checks([(claims[i], plans[i], out) for i, out in zip(members, outs)], ref, evs)
    except Exception as exc:
        log.warning("checking %d mixed-version claims together failed (%r): one by one", len(members), exc)
        evs = [Evidence() for _ in members]
        checked = [_verify_mixed(claims[i], plans[i], ref, ev, out) for i, out, ev in zip(members, outs, evs)]
    for i, f, ev in zip(members, checked, evs):
        if f is not None and f.reason != Reason.UNJUDGED:
            # a failure of the batched recomputation stands only if the claim's own one-row recomputation (the
            # path that recomputed mixed claims before they were batched) fails it too
            ev, again = Evidence(), f
            f = _verify_mixed(claims[i], plans[i], ref, ev)
            if f is None:
                log.warning("claim %s: failed recomputed in a batch (%s: %s), passed alone: the batch's verdict "
                            "is dropped", claims[i].work_id, again.reason, again.detail[:200])
        failures[i] = f
        evidence[i].add(ev)


def _verify_mixed(claim: RolloutClaim, p: _Plan, ref: Reference, ev: Evidence, out: tuple | None = None) -> Failure | None:
    """A rollout whose tokens came from several versions: one forward per version segment, each
    attending to the KV the earlier versions wrote (`out`: that one-pass recomputation, done already by
    `_verify_mixed_group`), or turn by turn where the policy changed between turns; then every segment
    checked against its version."""
    start = len(claim.prompt_ids) - 1  # the position that produced completion token 0
    try:
        passes = None if out is not None else _turn_passes(claim)
        if passes is not None and len(passes) > MAX_TURN_PASSES:
            return Failure(Reason.MALFORMED, f"{len(passes)} turns across a version change: at most "
                           f"{MAX_TURN_PASSES} are recomputed", severity=Severity.BORDERLINE)
        if passes is not None:  # the policy changed between turns: recomputed turn by turn, as it ran
            out = _recompute_turns(claim, p, ref, passes)
        elif out is None:
            seq, segments, _, replay = _mixed_item(claim, p)
            out = ref.prefill_mixed(seq, segments, with_routes=p.routes is not None,
                                    with_router_logits=p.routes is not None, logits_from=start, replay=replay)
        return _mixed_checks([(claim, p, out)], ref, [ev])[0]
    except Exception as exc:
        log.warning("claim %s: unexpected error in mixed-version checks: %r", claim.work_id, exc)
        return _failure_of(exc)


def _mixed_checks(items: list[tuple[RolloutClaim, _Plan, tuple]], ref: Reference, evs: list[Evidence]
                  ) -> list[Failure | None]:
    """The checks of recomputed mixed-version claims ((claim, plan, its recomputation) each): every version
    segment of every claim through one `check_segments` (one measurement, one transfer back, as a version's
    claims are), each claim failing with its first failing segment; then the routes of those that passed,
    together. Raises what a check raised (the caller decides: one by one)."""
    owners, segments = [], []
    for k, (claim, p, out) in enumerate(items):
        start = len(claim.prompt_ids) - 1  # the position that produced completion token 0
        for v in p.tokens:
            owners.append(k)
            segments.append(_segment(claim, p, v, out[0], out[1], start, evs[k]))
    failures: list[Failure | None] = [None] * len(items)
    for k, f in zip(owners, check_segments(segments, ref)):
        failures[k] = failures[k] or f
    routed = [k for k, (_, p, _) in enumerate(items) if failures[k] is None and p.routes is not None]
    for k, f in zip(routed, _check_forced_routes([(items[k][0], items[k][1].routes, list(items[k][2][2:]))
                                                  for k in routed], ref.precision)):
        failures[k] = f
    return failures


def _resource_error(exc: BaseException) -> bool:
    """The validator ran out of memory (its GPU's or the host's): nothing the claim did."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError))


def _failure_of(exc: Exception, what: str = "claim could not be checked") -> Failure:
    """A claim's failure where recomputing or checking it raised: `unjudged` (no strike) if the validator ran
    out of memory, else `malformed`: the claim made the reference fail."""
    if _resource_error(exc):
        return Failure(Reason.UNJUDGED, f"out of memory: {exc!r}"[:500], severity=Severity.NONE)
    return Failure(Reason.MALFORMED, f"{what}: {exc!r}"[:500])


def _halves_after(exc: Exception, what: str, members: list[int], claims: list[RolloutClaim],
                  failures: list[Failure | None], retry: Callable[[list[int]], None]) -> None:
    """A recomputation of `members` together raised: each half is tried again (`retry`), down to one claim,
    whose failure it then is (`_failure_of`). So one claim that makes the reference fail fails alone, not
    every claim recomputed beside it (other submitters' too), and a group too large for the memory left is
    judged in smaller ones: at most 2 log2(n) more recomputations for one such claim among n."""
    if _resource_error(exc) and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the failed group's blocks back to the device (other roles share it)
    if len(members) > 1:
        log.warning("%s: %d claims together failed (%r): in halves", what, len(members), exc)
        mid = len(members) // 2
        retry(members[:mid])
        retry(members[mid:])
        return
    i = members[0]
    log.warning("claim %s: %s failed: %r", claims[i].work_id, what, exc)
    failures[i] = failures[i] or _failure_of(exc, f"{what} failed")


def _segment(claim: RolloutClaim, p: _Plan, v: int, logits: torch.Tensor, hidden: torch.Tensor, start: int,
             ev: Evidence) -> Segment:
    """Version v's sampled tokens of `claim` with their rows of the recomputation (`logits` from the row that
    produced completion token 0, `hidden` from position 0): views where the tokens are one run (a
    single-turn, single-version rollout), gathered rows otherwise."""
    idx = p.tokens[v]
    if idx == list(range(idx[0], idx[0] + len(idx))):
        rows_logits, rows_hidden = logits[idx[0] : idx[0] + len(idx)], hidden[start + idx[0] : start + idx[0] + len(idx)]
    else:
        rows = torch.tensor(idx, device=logits.device)
        rows_logits, rows_hidden = logits[rows], hidden[rows + start]
    return Segment(claim, idx, rows_logits, rows_hidden, p.spans[v], p.commitments[v], p.chunk_offsets[v], ev)


def _router_logits(extra: list) -> torch.Tensor | None:
    """The router logits a Reference returned after the routes (an older Reference returns none)."""
    return extra[1] if len(extra) > 1 else None


PREFILL_LOGITS_BYTES = 256 << 20
"""Completion logits (float32 [tokens, vocab]) one prefill may hand back: a version's claims are prefilled
and checked in groups under this, each group's logits dropped before the next, so a round of any size
holds at most this much (SmolLM2's 49,152-token vocabulary: ~1,360 completion tokens; Qwen3's 151,936:
~440); a claim longer than that is a group of its own."""


def _logit_groups(members: list[int], claims: list[RolloutClaim], vocab_size: int,
                  budget: int = PREFILL_LOGITS_BYTES) -> list[list[int]]:
    groups: list[list[int]] = [[]]
    size = 0
    for i in members:
        n = 4 * vocab_size * len(claims[i].token_ids)
        if groups[-1] and size + n > budget:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def _verify_group(v: int, members: list[int], claims: list[RolloutClaim], plans: list[_Plan | None],
                  failures: list[Failure | None], ref: Reference, evidence: list[Evidence]) -> None:
    """Prefill `members` (claims of version v, all with routes or all without) together and record each
    one's failure, if any: logits only from each completion's first producing position (the prompt's rows
    are never checked); claims with routes are recomputed along them (`_check_forced_routes`)."""
    seqs = [claims[i].prompt_ids + claims[i].token_ids[:-1] for i in members]
    starts = [len(claims[i].prompt_ids) - 1 for i in members]
    with_routes = plans[members[0]].routes is not None
    try:
        outs = ref.prefill(v, seqs, with_routes=with_routes, with_router_logits=with_routes, logits_from=starts,
                           replay=[plans[i].routes for i in members] if with_routes else None)
    except Exception as exc:
        _halves_after(exc, f"prefill of version {v}", members, claims, failures,
                      lambda half: _verify_group(v, half, claims, plans, failures, ref, evidence))
        return
    # every member measured together (`check_segments`); should that fail, one by one, so that the claim it
    # failed on is the only one that fails with it
    todo = [(i, start, out) for i, start, out in zip(members, starts, outs) if failures[i] is None]
    segments: dict[int, Segment] = {}
    for i, start, (logits, hidden, *_) in todo:
        try:
            segments[i] = _segment(claims[i], plans[i], v, logits, hidden, start, evidence[i])
        except Exception as exc:
            _unexpected(claims[i], exc, failures, i)
    try:
        failures_of = dict(zip(segments, check_segments(list(segments.values()), ref)))
    except Exception as exc:
        log.warning("measuring %d claims of version %d together failed (%r): one by one", len(segments), v, exc)
        failures_of = {}
        for i, seg in segments.items():
            try:
                failures_of[i] = check_segments([seg], ref)[0]
            except Exception as exc_i:
                _unexpected(claims[i], exc_i, failures, i)
    for i, f in failures_of.items():
        failures[i] = f
    routed = [(i, routes) for i, _, (_, _, *routes) in todo if failures[i] is None and plans[i].routes is not None]
    try:
        for (i, _), f in zip(routed, _check_forced_routes([(claims[i], plans[i].routes, r) for i, r in routed],
                                                          ref.precision)):
            failures[i] = f
    except Exception as exc:
        log.warning("route checks of %d claims together failed (%r): one by one", len(routed), exc)
        for i, r in routed:
            try:
                failures[i] = _check_forced_routes([(claims[i], plans[i].routes, r)], ref.precision)[0]
            except Exception as exc_i:
                _unexpected(claims[i], exc_i, failures, i)


def _unexpected(claim: RolloutClaim, exc: Exception, failures: list[Failure | None], i: int) -> None:
    log.warning("claim %s: unexpected error in recomputation checks: %r", claim.work_id, exc)
    failures[i] = _failure_of(exc)


def _check_forced_routes(items: list[tuple[RolloutClaim, torch.Tensor, list]], precision: str) -> list[Failure | None]:
    """The recomputation ran along the claimed routes (teacher forcing: an honest near-tie decided
    the other way in the engine's decode then changes no later position); each claimed set is checked
    against the top-k of the router logits that same pass computed at its position. `items`: (claim,
    claimed routes, what the prefill returned after the hidden states), checked together
    (`routing.check_routes_many`)."""
    return check_routes_many([(c, claimed, extra[0], _router_logits(extra)) for c, claimed, extra in items], precision,
                             forced=True)


def _pool(claims: list[RolloutClaim], failures: list[Failure | None], evidence: list[Evidence],
          precision: str, shape: str | None) -> None:
    """The pooled check of each submission (the claims sharing a work id): the claims of it that passed
    alone, their evidence summed, must pass `verification.pooled`'s bounds together, or each fails with it
    (a claim that failed alone has already failed its unit, and its figures would only blur the rest's)."""
    units: dict[int, list[int]] = {}
    for i, claim in enumerate(claims):
        if failures[i] is None:
            units.setdefault(claim.work_id, []).append(i)
    for members in units.values():
        pooled = Evidence()
        for i in members:
            pooled.add(evidence[i])
        f = check_pooled(pooled, precision, len(members), shape=shape)
        if f is not None:
            for i in members:
                failures[i] = Failure(f.reason, f.detail, severity=f.severity)


def verify_claims(claims: list[RolloutClaim], ref: Reference, key: NodeKey | None = None,
                  engines: tuple[str, ...] = BUILTIN_ONLY, evidence: list[Evidence] | None = None) -> list[Verdict]:
    """One verdict per claim, in order; signed when `key` is given. `engines`: those the run spec
    accepts (`RunSpec.engines`); a claim naming another is rejected before anything is recomputed,
    so claiming vLLM cannot dodge the sampling check in a run that does not accept vLLM. The claims
    of one work id are one submission, also judged together (`_pool`); `evidence`, an empty list,
    receives what each claim's recomputation measured (benchmarks, calibration)."""
    evidence = evidence if evidence is not None else []
    evidence[:] = [Evidence(positions=len(c.prompt_ids) + len(c.token_ids)) for c in claims]
    failures: list[Failure | None] = [None] * len(claims)
    plans: list[_Plan | None] = [None] * len(claims)
    for i, claim in enumerate(claims):
        if claim.engine not in engines:
            failures[i] = Failure(Reason.ENGINE_NOT_ALLOWED, f"engine {claim.engine!r} is not one this run "
                                  f"accepts ({', '.join(engines)})")
            continue
        try:
            p = _plan(claim, ref)
            if isinstance(p, Failure):
                failures[i] = p
                continue
            failures[i] = check_task(claim, ref) or check_termination(claim, ref)
            plans[i] = p
        except Exception as exc:  # a claim must never take the validator down
            log.warning("claim %s: unexpected error in cheap checks: %r", claim.work_id, exc)
            failures[i] = _failure_of(exc)
    by_version: dict[int, list[int]] = {}
    mixed: list[int] = []
    for i, p in enumerate(plans):
        if p is not None and failures[i] is None:
            if len(p.tokens) == 1:
                by_version.setdefault(next(iter(p.tokens)), []).append(i)
            else:
                mixed.append(i)
    budget = getattr(ref, "logits_bytes", None) or PREFILL_LOGITS_BYTES  # a GPU reference sizes its own
    # newest first (a resident model holds the newest after a hold), then the mixed claims oldest version up:
    # each version is switched to about twice a round, however many claims there are
    for v, members in sorted(by_version.items(), reverse=True):
        for routed in (False, True):  # a prefill is forced along claimed routes for all its rows or none
            same = [i for i in members if (plans[i].routes is not None) == routed]
            for group in _logit_groups(same, claims, ref.vocab_size, budget) if same else []:
                _verify_group(v, group, claims, plans, failures, ref, evidence)
    for routed in (False, True):
        same = [i for i in mixed if (plans[i].routes is not None) == routed]
        for group in _logit_groups(same, claims, ref.vocab_size, budget) if same else []:
            _verify_mixed_group(group, claims, plans, failures, ref, evidence)
    _pool(claims, failures, evidence, ref.precision, ref.shape)
    verdicts = []
    for claim, f in zip(claims, failures):
        v = Verdict(work_id=claim.work_id, claim_digest=claim.digest(), accepted=f is None,
                    reason=Reason.OK if f is None else f.reason, chunk=f and f.chunk, token=f and f.token,
                    severity=Severity.NONE if f is None else f.severity,
                    detail="" if f is None else f.detail[:512])
        verdicts.append(v.signed(key) if key is not None else v)
    return verdicts
