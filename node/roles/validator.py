"""Validator role: judge accepted work units (the coordinator hands out those its selector picks,
all of them at `verification_rate` 1.0), sign verdicts, send them back.

Invariants: every unit handed out gets exactly one verdict (one whose policy version cannot be
fetched is offered again, and after `UNJUDGEABLE_AFTER_S` of that, while other versions were fetched,
gets a borderline failing verdict: a strike, never a unit deferred forever; one whose version is still being
fetched and held waits for the next round, and the round judges the others); a group is valid only if every one of
its rollouts passes `verification.validator.verify_claims` against the policy version(s) that
produced it; nothing a submission holds can crash the validator (an unreadable unit is a `malformed`
rejection).

One resident model per validator (`node.roles.resident_policy.ResidentPolicies`): the newest version's
weights on its device, every other version still judged held on the host as a delta and applied in
place while its claims are recomputed (bit for bit the weights a model of that version alone holds),
not k + 3 whole models.

FP8 runs (`RunSpec.model.fp8` experts | all): the resident model is made as the inference nodes make
theirs (`resident_model`: FP8 modules swapped in before allocation, `apply_fp8_mode`'s rule), each version
quantised as it arrives or, in its served form, held as published, so the recomputation sees the same e4m3
weights and the checks apply that precision's thresholds (`TorchReference.precision` -> verification/checks.py).

Routed experts (router replay) a submission carries are checked against the same recomputation
(`verification.routing`): bytes that cannot be the model's routes, or routes that differ from the
claimed version's beyond honest variation, reject the unit. A submission without routes is judged
on everything else and accepted: routes are optional in the protocol (vLLM nodes, older nodes and
dense models send none), a missing route asserts nothing false, and the trainer then trains that
batch without replay (docs/node.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from node.model.qwen3_moe import CausalLM
from node.engine.weight_staging import StagedVersion
from node.engine.weights import expected_shapes
from node.recipe import Recipe
from node.replay import TorchReference, env_oracle
from node.roles.common import blank_model, check_version0, environment, fetch_policy, tokenizer
from node.heap import Collections, settle_heap
from node.roles.model_turns import ModelTurns
from node.roles.resident_policy import PreparedVersion, ResidentPolicies
from node.roles.version0 import LocalVersion0, local_version0
from protocol.client import CoordinatorClient
from protocol.errors import ProtocolError
from protocol.identity import NodeKey
from protocol.messages import PolicyAnnounce, RunSpec, Verdict
from protocol.work import AcceptedGroup, OpenedUnit, UnreadableUnit, sampling_seed
from shardcast.store import Store
from verification.checks import Reason, Severity
from verification.claim import RolloutClaim, SamplingSpec
from verification.pooled import POOLED_DETAIL
from verification.validator import verify_claims

log = logging.getLogger(__name__)

PREFETCH_FOR_S = 15.0
"""How long a version announced is tried again (in fetches of 3 attempts, ~1.2 s each, so a judging round
that needs it meanwhile waits for one of them only) until held, while no newer one is announced. A version is
announced once listed beside the trainer, before its wire shards exist (`shardcast.publish.publish_stream`):
a validator on another host is told it is not there until they are (seconds for a 10 GB version)."""
UNJUDGEABLE_AFTER_S = 60.0
"""How long a unit's policy version may stay unfetchable before the unit fails as unjudgeable (a
borderline verdict: a strike against its submitter, `protocol.judging.STRIKES_TO_BAN`). Counted only
while this validator fetched some other version meanwhile, so an origin that is down strikes nobody
(the coordinator drops such units unstruck, `protocol.pipeline.JUDGE_LIMBO_S`). Admission already
refuses versions nobody published; 60 s is 3 of `fetch_policy`'s tries with room for a slow relay."""


class ValidatorNode:
    def __init__(self, key: NodeKey, spec: RunSpec, bootstrap: str, workdir: Path, batch: int = 64,
                 device: str = "cpu", store: Store | None = None):
        """`store`: the host's shardcast store (`join --store`; default WORKDIR/shardcast)."""
        self.key, self.spec, self.bootstrap, self.workdir = key, spec, bootstrap, workdir
        self.store = store or Store(workdir / "shardcast")
        self.version0 = LocalVersion0(spec)
        """This member's checkpoint as version 0 (checked once): held as is, and version 1's delta parent."""
        self.device = device
        """Where the validator recomputes (`join --device`)."""
        # a round's logits stay bounded whatever its size: only completion rows, checked in groups under
        # verification.validator.PREFILL_LOGITS_BYTES and dropped group by group
        self.batch = batch
        self.tok = tokenizer(spec)
        self.env = environment(spec)
        self.recipe = Recipe.of(spec)
        self.hashes: dict[int, str] = {}
        self.policies: ResidentPolicies | None = None
        """The versions this validator can judge (None until the first is fetched)."""
        self.judged = self.rejected = 0
        self.on_round: list = []
        """Hooks told each judging round ({t0, t1, units, tokens, completion_tokens, verify_s, turn_wait_s, versions,
        mixed, alone, gc_s, gc_full}: tokens recomputed (prompts' and completions'), of them the completions', seconds
        spent recomputing them (without fetching versions; since session 22 without waiting for the model either),
        seconds the round waited for its turn on the model, the policy versions its claims name, claims of more than one
        version, whether it had the model alone (it switched versions), the garbage collector's seconds and full passes
        inside the round); node/version_trace.py."""
        self.on_held: list = []
        """Hooks told (version, {t_held, fetch_s, hold_s, behind_s, prepare_s, changed_bytes}) once a version is held:
        when (Unix seconds), its fetch, the hold after it, of which waiting behind other holds, and for one prepared
        beside the judging its preparation and the changed bytes its step was built from (None: read whole; both None
        for a version held alone); node/version_trace.py writes them to WORKDIR/versions.jsonl."""
        self.on_evidence: list = []
        """Hooks given each round's claims' `verification.pooled.Evidence` as rows (`evidence_rows`): a traced
        validator (`--trace-versions`) appends them to WORKDIR/evidence.jsonl, which `benchmarks.pooled_calibration`
        reads."""
        self._round_tokens, self._round_verify_s, self._round_turn_wait_s = 0, 0.0, 0.0
        self._round_completion_tokens = 0
        self._round_shape = {"versions": 0, "mixed": 0, "alone": False}
        self._collections = Collections()
        """The collector's seconds and full passes, counted while `run` runs (a round's row says its share)."""
        self._deferred: dict[int, float] = {}
        """Work id -> when its policy version was first found unfetchable (monotonic)."""
        self._fetched_at = float("-inf")
        """When a policy version was last fetched (monotonic)."""
        self._holding: dict[int, asyncio.Task] = {}
        """Version -> its fetch and hold in progress (one per version, whoever asked first)."""
        self._hold_order = asyncio.Lock()
        """Holds run one at a time, in the order asked (the first builds the resident model)."""
        self._turns = ModelTurns()
        """Who uses the resident model when (node/roles/model_turns.py): rounds that judge the newest version
        beside a hold preparing the next one; a round that switches versions, a hold reading one in, alone."""

    async def run(self, stop: asyncio.Event) -> None:
        client = await CoordinatorClient.connect(self.key, self.spec, "validator", self.bootstrap, stop)
        client.on_policy(self._on_announce)
        self._collections.on = True
        try:
            while not stop.is_set():
                items = await client.to_verify(self.batch)
                if not items:
                    await asyncio.sleep(0.1)
                    continue
                t0, gc_s, gc_full = time.time(), self._collections.seconds, self._collections.full
                verdicts = await self._judge(items)
                for hook in self.on_round if verdicts else ():
                    hook({"t0": t0, "t1": time.time(), "units": len(verdicts), "tokens": self._round_tokens,
                          "completion_tokens": self._round_completion_tokens, "verify_s": self._round_verify_s,
                          "turn_wait_s": self._round_turn_wait_s,
                          **self._round_shape, "gc_s": self._collections.seconds - gc_s,
                          "gc_full": self._collections.full - gc_full})
                if not verdicts:  # nothing judgeable yet (a version being held, or not fetchable): do not spin
                    await self.until_a_hold_ends(0.5)
                    continue
                await client.verdicts(verdicts)
        except asyncio.CancelledError:
            pass
        finally:
            self._collections.close()  # the process's collector callbacks hold no stopped validator
            await client.close("validator stopping")
            log.info("validator stopped: %d units judged, %d rejected", self.judged, self.rejected)

    async def _on_announce(self, msg: PolicyAnnounce) -> None:
        """Hold an announced version at once, before any unit needs it: its fetch and hold (seconds for a
        10 GB version) then overlap the inference nodes' own fetch and generation, off the path from a
        step to the next batch's verdicts (session 7's 5.2B run: 8-10 s a version on that path)."""
        self.hashes[msg.version] = msg.manifest_hash
        if msg.version >= max(self.hashes):
            asyncio.create_task(self._prefetch(msg.version))

    async def _prefetch(self, version: int) -> None:
        until = time.monotonic() + PREFETCH_FOR_S
        while True:
            try:
                await self._policy(version)
                return
            except Exception as exc:  # noqa: BLE001 - a unit that needs it asks again (and defers, as before)
                if time.monotonic() > until or version < max(self.hashes):
                    log.warning("policy v%d not held ahead of its units: %s", version, exc)
                    return
            await asyncio.sleep(0.5)

    def _held(self, version: int) -> bool:
        return self.policies is not None and version in self.policies

    async def until_a_hold_ends(self, timeout_s: float) -> None:
        """Return when a hold in progress ends (its units can then be judged), or after `timeout_s`."""
        holds = list(self._holding.values())
        if holds:
            await asyncio.wait(holds, timeout=timeout_s)
        else:
            await asyncio.sleep(timeout_s)

    async def _policy(self, version: int) -> None:
        if self._held(version):
            return
        task = self._holding.get(version)
        if task is None:
            task = self._holding[version] = asyncio.create_task(self._fetch_and_hold(version))
            task.add_done_callback(lambda _: self._holding.pop(version, None))
        await asyncio.shield(task)  # a cancelled judging round leaves the hold to finish for the next

    async def _fetch_and_hold(self, version: int) -> None:
        t0 = time.monotonic()
        state = await local_version0(self.spec, self.store, self.hashes.get(version), self.version0) if version == 0 else None
        local = state is not None  # checked against the signed manifest's shard hashes (node/roles/version0.py)
        if state is None:
            # a version newer than the resident one comes with its bytes against it where the store holds both (a
            # trainer on this host listed it, never a delta decoded here): its step is then built from them, not
            # from a whole read (`ResidentPolicies._step_from_changes`)
            newest = self.policies.newest if self.policies is not None else None
            state = await fetch_policy(self.spec, self.store, version, self.hashes.get(version), tries=3, local=self.version0,
                                       changes_of=newest if newest is not None and version > newest else None)
        self._fetched_at = time.monotonic()
        if version not in self.hashes:
            self.hashes[version] = self.store.held_manifest(self.spec.run_id, version).manifest.manifest_hash()
        # off the event loop: building and checking a model takes seconds of CPU on a busy machine, and a
        # blocked loop sends no heartbeat (the sim's validator was ejected so, issue 28)
        t_fetched = time.monotonic()
        async with self._hold_order:
            t_hold = time.monotonic()
            prepared = await self._hold(version, state, bytes.fromhex(self.hashes[version]), local)
        hold_s = time.monotonic() - t_fetched
        log.info("version %d: fetched in %.2f s, held %.2f s after (%.2f s behind other holds)", version,
                 t_fetched - t0, hold_s, t_hold - t_fetched)
        row = {"t_held": time.time(), "fetch_s": t_fetched - t0, "hold_s": hold_s,
               "behind_s": t_hold - t_fetched, "prepare_s": None if prepared is None else prepared.prepare_s,
               "changed_bytes": None if prepared is None else prepared.changed_bytes}
        for hook in self.on_held:
            hook(version, row)
        if self.spec.model.fp8 != "off":
            log.info("version %d: recomputed with FP8 weights (%s), as the run's nodes serve it", version,
                     self.spec.model.fp8)

    async def _hold(self, version: int, state: Mapping[str, torch.Tensor], manifest_hash: bytes,
                    local: bool = False) -> PreparedVersion | None:
        """The first version builds the resident model; a newer one is prepared beside the rounds that judge the
        newest (`ResidentPolicies.prepare`, a reader's turn) and read in alone (`commit`); an older one is added
        alone. Each off the event loop: building and checking a model takes seconds of CPU on a busy machine,
        and a blocked loop sends no heartbeat (the sim's validator was ejected so, issue 28). A fetched version 0
        is checked against the spec's pin first, on the high-precision tensors the trainer published, before
        anything is loaded (a local version 0 was checked against it as its checkpoint was read). Returns the
        prepared version where one was committed (None: held alone, or held already)."""
        if version == 0 and not local:
            await asyncio.to_thread(check_version0, self.spec, state)
        if self.policies is not None and version in self.policies:
            return None
        if self.policies is None or version < self.policies.newest:
            await self._turns.write()
            try:
                await asyncio.to_thread(self._add_alone, version, state, manifest_hash)
            finally:
                await self._turns.leave(reader=False)
            return None
        policies = self.policies
        reader = await self._turns.enter(lambda: policies.at_newest)
        try:
            if not reader:  # a round left another version active: the newest back first, then read beside
                await asyncio.to_thread(policies.activate, policies.newest)
                await self._turns.downgrade()
                reader = True
            try:
                prepared = await asyncio.to_thread(policies.prepare, version, state, manifest_hash)
            except torch.cuda.OutOfMemoryError as exc:  # no room for a module's scratch copy beside the rounds
                log.warning("version %d: no GPU memory to prepare it beside the judging (%s); held alone instead",
                            version, str(exc).splitlines()[0][:200])
                prepared = None
            await self._turns.upgrade()
            reader = False
            if prepared is None:
                await asyncio.to_thread(self._add_alone, version, state, manifest_hash)
            else:
                await asyncio.to_thread(policies.commit, prepared)
        finally:
            await self._turns.leave(reader)
        return prepared

    def _add_alone(self, version: int, state: Mapping[str, torch.Tensor], manifest_hash: bytes) -> None:
        if self.policies is None:
            self.policies = ResidentPolicies(resident_model(self.spec, self.device, state), version, manifest_hash)
            settle_heap()  # the model is held: full collector passes no longer walk it mid-round
            return
        self.policies.add(version, state, manifest_hash)

    async def _prune(self) -> None:
        """Drop models of versions no rollout can still be admitted with (after a judging round, never during
        one: a claim's versions must all be present while it is checked; a writer's turn: a drop switches the
        weights)."""
        newest = max(self.hashes, default=-1)
        held = self.policies
        old = [] if held is None else [v for v in held if v < newest - self.spec.max_off_policy_steps - 2
                                       and v != held.newest]
        if old:
            await self._turns.write()
            try:
                await asyncio.to_thread(lambda: [held.drop(v) for v in old if v in held])
            finally:
                await self._turns.leave(reader=False)
        forget = time.monotonic() - 10 * UNJUDGEABLE_AFTER_S  # units the coordinator no longer offers
        self._deferred = {w: t for w, t in self._deferred.items() if t > forget}

    async def _judge(self, items: list[OpenedUnit]) -> list[Verdict]:
        claims: dict[int, list[RolloutClaim]] = {}
        failed: dict[int, tuple[str, str]] = {}
        submitters: dict[int, str] = {}
        skipped: set[int] = set()
        borderline: set[int] = set()
        for item in items:
            submitters[item.work_id] = item.submitter
            if isinstance(item, UnreadableUnit):
                failed[item.work_id] = (item.submitter, f"malformed: {item.error}"[:500])
                continue
            try:
                claims[item.work_id] = [self._claim(item, j, sub) for j, sub in enumerate(item.group.rollouts)]
            except (ProtocolError, ValueError, KeyError) as exc:
                failed[item.work_id] = (item.submitter, f"malformed: {exc}"[:500])
                claims.pop(item.work_id, None)
                continue
            needed = sorted({v for c in claims[item.work_id] for v in c.versions})
            if any(v in self._holding and not self._held(v) for v in needed):
                # a version still being fetched and held (seconds at 5.2B) holds back its own units, not the
                # round's others: they come back with the next `to_verify` (session 38's 5.2B network waited
                # 5-7 s a round here, and its inference node, out of leases, stood idle)
                claims.pop(item.work_id)
                skipped.add(item.work_id)
                continue
            try:
                for v in needed:
                    await self._policy(v)  # the coordinator refuses versions it has not announced
            except ProtocolError as exc:
                # Maybe not the submitter's fault: no verdict now (the unit is offered again, or goes
                # stale), unless it stays unjudgeable while other versions could be fetched.
                claims.pop(item.work_id, None)
                first = self._deferred.setdefault(item.work_id, time.monotonic())
                if time.monotonic() - first < UNJUDGEABLE_AFTER_S or self._fetched_at <= first:
                    log.warning("work %d: policy not available (%s); judged later", item.work_id, exc)
                    skipped.add(item.work_id)
                    continue
                failed[item.work_id] = (item.submitter, f"unjudgeable: no policy for "
                                        f"{time.monotonic() - first:.0f} s: {exc}"[:500])
                borderline.add(item.work_id)
            except (ValueError, KeyError) as exc:
                failed[item.work_id] = (item.submitter, f"malformed: {exc}"[:500])
                claims.pop(item.work_id, None)
        flat = [(wid, c) for wid, cs in claims.items() for c in cs]
        self._round_tokens = sum(len(c.prompt_ids) + len(c.token_ids) for _, c in flat)
        self._round_completion_tokens = sum(len(c.token_ids) for _, c in flat)
        self._round_verify_s = self._round_turn_wait_s = 0.0
        self._round_shape = {"versions": 0, "mixed": 0, "alone": False}  # nothing recomputed: no shape
        if flat:
            prompt_ids, reward = env_oracle(self.tok)
            ref = TorchReference(self.policies, eos_id=self.tok.eos_id, max_seq_len=fresh_model_max_len(self),
                                 decode=self.tok.decode, tasks=prompt_ids, reward=reward)
            versions = {v for _, c in flat for v in c.versions}
            policies = self.policies
            # a reader beside a hold preparing the next version when every claim is of the version the model
            # holds (nothing switches it), else a writer: the round's switches, or a hold's read-in, go alone
            t_turn = time.time()
            reader = await self._turns.enter(lambda: policies.at_newest and versions <= {policies.newest})
            self._round_shape = {"versions": len(versions), "mixed": sum(len(set(c.versions)) > 1 for _, c in flat),
                                 "alone": not reader}
            t_verify = time.time()
            self._round_turn_wait_s = t_verify - t_turn  # behind a hold reading a version in (not busy time)
            try:
                evidence: list = []
                verdicts = await asyncio.to_thread(verify_claims, [c for _, c in flat], ref, None, self.spec.engines,
                                                   evidence)
            finally:
                await self._turns.leave(reader)
            self._round_verify_s = time.time() - t_verify
            for hook in self.on_evidence:
                hook(evidence_rows(flat, verdicts, evidence, ref, submitters))
            unjudged = set()
            for (wid, _), v in zip(flat, verdicts):
                if v.reason == Reason.UNJUDGED:  # out of memory recomputing it: no evidence either way
                    unjudged.add(wid)
                    continue
                if v.accepted or (wid in failed and (wid not in borderline or v.severity == Severity.BORDERLINE)):
                    continue  # passed, or the group's verdict already holds a failure at least as strong
                failed[wid] = (submitters[wid], f"{getattr(v.reason, 'value', v.reason)}: {v.detail}"[:500])
                # the group is borderline only if every failing claim in it is
                (borderline.add if v.severity == Severity.BORDERLINE else borderline.discard)(wid)
            for wid in unjudged - set(failed):  # a failure of another of its claims stands; else judged later
                log.warning("work %d: not judged (the validator ran out of memory recomputing it); offered again", wid)
                skipped.add(wid)
        await self._prune()
        out = []
        for item in items:
            if item.work_id in skipped:
                continue
            self._deferred.pop(item.work_id, None)
            bad = failed.get(item.work_id)
            out.append(Verdict(work_id=item.work_id, submitter=item.submitter,
                               valid=bad is None, reason="" if bad is None else bad[1],
                               severity="borderline" if item.work_id in borderline else "proof"))
        self.judged += len(out)
        self.rejected += sum(not v.valid for v in out)
        for v in out:
            if not v.valid:
                log.warning("work %d from %s rejected: %s", v.work_id, v.submitter, v.reason)
        return out

    def _claim(self, item: AcceptedGroup, j: int, sub) -> RolloutClaim:
        task = self.env.sample_task(item.task_index)
        return RolloutClaim(
            work_id=item.work_id, env=self.spec.environment, task_seed=item.task_index,
            prompt_ids=task.prompt_ids(self.tok),
            token_ids=sub.token_ids, logprobs=sub.logprobs, versions=sub.token_versions, sampled=sub.sampled,
            sampling=SamplingSpec(temperature=self.recipe.temperature,
                                  max_new_tokens=self.env.new_tokens(task), seed=sampling_seed(item.seed, j),
                                  stop_strings=tuple(self.env.stop_strings)),
            finish_reason=sub.finish_reason, reward=sub.reward, proof=sub.proof, engine=sub.engine,
            routed_experts=sub.routed_experts)


def fresh_model_max_len(node: ValidatorNode) -> int:
    return node.policies.model.config.max_position_embeddings


def resident_model(spec: RunSpec, device: str | torch.device, state: Mapping[str, torch.Tensor]) -> CausalLM:
    """The validator's model of its first version, made as an inference node makes its own: an FP8 run's
    modules swapped in before allocation (the same blocks, the same layers: docs/fp8.md), then the version
    tensor by tensor from the payload's mapping, experts into their rows (no stacked copy on the host); an FP8
    module quantises a high-precision tensor as it arrives, or holds a version's served-form bytes as they
    are (node/model/served_form.py), as the node's engine does."""
    model = blank_model(spec, device, spec.model.fp8)
    StagedVersion.of(model, state, expected_shapes(model), stage=False).apply()
    return model.eval()


def evidence_rows(flat: list[tuple[int, RolloutClaim]], verdicts: list, evidence: list, ref: TorchReference,
                  submitters: dict[int, str]) -> list[dict]:
    """One row per judged claim (`verdicts`: `verify_claims`'s, in order) in `benchmarks.pooled_calibration`'s
    form: its work id, submitter, whether it passed alone (accepted, or rejected only by its submission's pooled
    check) and its evidence sums. `case` "network": nobody here knows whether a claim was honest (a benchmark whose
    nodes all are says so when it calibrates: `pooled_calibration --honest network`); `engine_device`: the engine
    the claim names."""
    rows = []
    for (wid, claim), v, ev in zip(flat, verdicts, evidence):
        if v.reason == Reason.UNJUDGED:
            continue
        rows.append({"precision": ref.precision, "case": "network", "shape": ref.shape, "engine_device": claim.engine,
                     "judge_device": str(ref.device), "batch": "network", "work_id": wid,
                     "submitter": submitters[wid], "tokens_claimed": len(claim.token_ids),
                     "passed_alone": v.accepted or str(v.detail).startswith(POOLED_DETAIL), **vars(ev)})
    return rows
