"""The cross-device fixture on disk, and its judging by the validator role's path on any device.

A fixture is one directory (docs/verification.md, "Cross-device fixture"):
    config.json, model.safetensors   version 0's weights (HF layout, the dtype the run's spec names)
    claims.jsonl                     one `RolloutClaim` per line (bytes base64), as the validator role
                                     builds them from the submissions (`ValidatorNode._claim`)
    provenance.json                  the run spec, the manifest hash, each claim's case, and where and
                                     how the rollouts were generated (device, torch, engine, graphs, date)
The manifest hash the proofs are bound to is the sha256 of model.safetensors, so a claim cannot be
paired with other weights. Invariant: `judge` builds the reference exactly as `ValidatorNode` does for
one version (blank model of the spec on the role's device, HF weights loaded in place, the spec's FP8
mode applied, `TorchReference` over the built-in environments) and calls `verify_claims` as it does.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from protocol.messages import RunSpec
from verification.claim import RolloutClaim
from verification.verdict import Verdict

CLAIMS, PROVENANCE, WEIGHTS = "claims.jsonl", "provenance.json", "model.safetensors"


@dataclass
class Fixture:
    spec: RunSpec
    claims: list[RolloutClaim]
    cases: list[str]
    """The case of each claim (`env/batchN/tT`), in claim order."""
    provenance: dict
    directory: Path

    @property
    def generated_on(self) -> str:
        p = self.provenance
        return f"{p['device_name']} ({p['device']}, {p['engine']}, graphs {'on' if p['graphs'] else 'off'}, " \
               f"torch {p['torch']}, {p['dtype']}, {p['date']})"


def manifest_hash(directory: Path) -> bytes:
    return hashlib.sha256((directory / WEIGHTS).read_bytes()).digest()


def write_fixture(directory: Path, spec: RunSpec, claims: list[RolloutClaim], cases: list[str],
                  provenance: dict) -> dict:
    """Write the claims and the provenance beside the weights `write_weights` wrote (the claims' proofs
    must be bound to their `manifest_hash`); returns the provenance record."""
    with open(directory / CLAIMS, "w") as f:
        for c in claims:
            f.write(c.model_dump_json() + "\n")
    record = {**provenance, "spec": json.loads(spec.model_dump_json()), "manifest_hash": manifest_hash(directory).hex(),
              "cases": cases}
    (directory / PROVENANCE).write_text(json.dumps(record, indent=1) + "\n")
    return record


def write_weights(directory: Path, model) -> bytes:
    """Version 0's weights as config.json + model.safetensors; returns the manifest hash they give."""
    from node.model.checkpoint import save_checkpoint

    directory.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, directory)
    return manifest_hash(directory)


def read_fixture(directory: Path) -> Fixture:
    directory = Path(directory)
    prov = json.loads((directory / PROVENANCE).read_text())
    claims = [RolloutClaim.model_validate_json(line) for line in (directory / CLAIMS).read_text().splitlines() if line]
    if len(prov["cases"]) != len(claims):
        raise ValueError(f"{directory}: {len(claims)} claims but {len(prov['cases'])} cases")
    return Fixture(RunSpec.model_validate(prov["spec"]), claims, prov["cases"], prov, directory)


def reference(fx: Fixture, device: str = "cpu"):
    """The validator role's `TorchReference` over the fixture's version 0, its model on `device`."""
    from node.engine.fp8.model import apply_fp8_mode
    from node.model.checkpoint import load_hf_state_dict, read_weights
    from node.replay import TorchReference, env_oracle
    from node.roles.common import blank_model, check_device, tokenizer

    check_device(device)
    model = blank_model(fx.spec, device)
    load_hf_state_dict(model, read_weights(fx.directory))
    apply_fp8_mode(model, fx.spec.model.fp8)
    manifest = manifest_hash(fx.directory)
    if manifest.hex() != fx.provenance["manifest_hash"]:
        raise ValueError(f"{fx.directory}: weights hash to {manifest.hex()[:16]}.., the provenance says "
                         f"{fx.provenance['manifest_hash'][:16]}..")
    tok = tokenizer(fx.spec)
    prompt_ids, reward = env_oracle(tok)
    return TorchReference({0: (model.eval(), manifest)}, eos_id=tok.eos_id,
                          max_seq_len=model.config.max_position_embeddings, decode=tok.decode, tasks=prompt_ids,
                          reward=reward)


def judge(fx: Fixture, claims: list[RolloutClaim] | None = None, device: str = "cpu", ref=None) -> list[Verdict]:
    """One verdict per claim (the fixture's own by default), as the validator role's `verify_claims` call."""
    from verification.validator import verify_claims

    return verify_claims(fx.claims if claims is None else claims, ref or reference(fx, device), None, fx.spec.engines)


@torch.inference_mode()
def drift(fx, ref, rows_out: list | None = None) -> dict:
    """The honest figures the checks judge, worst over the fixture (`verification.calibration.measure`'s
    fields, along the validator's path: batched prefills forced along the claimed routes, sampled tokens only;
    `logprob_err_mean_max` is the plain mean over any length, `logprob_err_checked_mean_max` the trimmed mean
    the check applies to rollouts of >= MIN_MEAN_TOKENS), beside the thresholds in force for its precision.
    `rows_out` gets each claim's own figures (a `RolloutFigures` and its checked mean or None), in order."""
    from verification.calibration.measure import RolloutFigures, summarize
    from verification.checks import MIN_MEAN_TOKENS, THRESHOLDS, _trimmed_mean
    from verification.hidden_check import compare_blocks
    from verification.proof import Commitment, chunk_blocks, chunk_spans, decode_rollout_proof
    from verification.routing import route_positions

    outs: list = [None] * len(fx.claims)
    for routed in (False, True):  # batched as `verify_claims` batches: forced along routes for all rows or none
        members = [i for i, c in enumerate(fx.claims) if (c.routed_experts is not None) == routed]
        if not members:
            continue
        cs = [fx.claims[i] for i in members]
        got = ref.prefill(0, [c.prompt_ids + c.token_ids[:-1] for c in cs], logits_from=[len(c.prompt_ids) - 1 for c in cs],
                          replay=[ref.decode_routes(c.routed_experts, route_positions(c)) for c in cs] if routed else None)
        for i, o in zip(members, got):  # logits stay where they were computed (measured there), hidden to the host
            outs[i] = (o[0], o[1].cpu())
    sampled = [[i for i, s in enumerate(c.sampled_mask) if s] for c in fx.claims]
    # the validator's own measurement (`Reference.measure_tokens`): on a GPU the rows are measured where their
    # logits are and only per-token figures come back (moving a 151,936-token vocabulary's logits to the host
    # and replaying them there took minutes for 512 rollouts of the 30B shape on an H100, session 20)
    measured = ref.measure_tokens([logits[torch.tensor(idx, dtype=torch.long, device=logits.device)]
                                   for (logits, _), idx in zip(outs, sampled)], [c.sampling for c in fx.claims],
                                  [[len(c.prompt_ids) + i for i in idx] for c, idx in zip(fx.claims, sampled)],
                                  [[c.token_ids[i] for i in idx] for c, idx in zip(fx.claims, sampled)])
    hiddens = [h for _, h in outs]
    del outs
    rows, means = [], []
    for c, hidden, idx, (ours, replay) in zip(fx.claims, hiddens, sampled, measured):
        start = len(c.prompt_ids) - 1
        rows_idx = torch.tensor(idx, dtype=torch.long)
        commitments = [Commitment.from_bytes(b) for r in decode_rollout_proof(c.proof, ref.hidden_size) for b in r.chunks]
        stats = compare_blocks(chunk_blocks(hidden[rows_idx + start], chunk_spans([c.versions[i] for i in idx])),
                               commitments)
        toks = torch.tensor([c.token_ids[i] for i in idx])
        err = (torch.tensor([c.logprobs[i] for i in idx]) - ours).abs()
        flips = replay.tokens != toks
        checked = _trimmed_mean(err) if len(idx) >= MIN_MEAN_TOKENS else None  # trimmed, long segments only
        if checked is not None:
            means.append(checked)
        rows.append(RolloutFigures(
            len(idx), len(stats), max(s.exp_mismatches for s in stats), max(s.mant_err_mean for s in stats),
            max(s.mant_err_median for s in stats), float(err.max()), float(err.mean()), int(flips.sum()),
            float(replay.margins[flips].max()) if bool(flips.any()) else 0.0))
        if rows_out is not None:
            rows_out.append((rows[-1], checked))
    worst = {**summarize(rows), "logprob_err_checked_mean_max": round(max(means, default=0.0), 5),
             "checked_mean_rollouts": len(means)}
    return {"precision": ref.precision, "honest_max": worst, "in_force": asdict(THRESHOLDS[ref.precision])}
