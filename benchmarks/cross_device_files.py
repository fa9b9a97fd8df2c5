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
from dataclasses import dataclass
from pathlib import Path

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
    from node.roles.common import blank_model, set_device, tokenizer

    set_device(device)
    try:
        model = blank_model(fx.spec)
    finally:
        set_device("cpu")  # the role's device is process-wide: leave it as found
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
