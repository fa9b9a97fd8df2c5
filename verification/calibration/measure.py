"""Raw honest-vs-recomputed figures of a batch of claims (no thresholds applied).

Used by the calibration script and the benchmark. One row per rollout: the worst chunk's
hidden-state stats, the largest and mean |logprob error| of its sampled tokens, and the largest
validator margin among tokens where the validator's seeded choice differs from the claim.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from verification.checks import token_logprobs
from verification.claim import RolloutClaim
from verification.hidden_check import compare_blocks
from verification.proof import Commitment, chunk_blocks, chunk_spans, decode_rollout_proof
from verification.reference import Reference


@dataclass
class RolloutFigures:
    tokens: int
    chunks: int
    exp_mismatches: int
    mant_err_mean: float
    mant_err_median: float
    logprob_err_max: float
    logprob_err_mean: float
    flips: int
    flip_margin_max: float

    def row(self) -> list:
        return [round(v, 5) if isinstance(v, float) else v for v in asdict(self).values()]


FIELDS = list(RolloutFigures.__dataclass_fields__)


def summarize(rows: list[RolloutFigures]) -> dict:
    """Maximum of every field over rollouts (sums for counts)."""
    out = {"rollouts": len(rows), "tokens": sum(r.tokens for r in rows), "chunks": sum(r.chunks for r in rows),
           "flips": sum(r.flips for r in rows)}
    for f in ("exp_mismatches", "mant_err_mean", "mant_err_median", "logprob_err_max", "logprob_err_mean",
              "flip_margin_max"):
        out[f + "_max"] = round(max((getattr(r, f) for r in rows), default=0.0), 5)
    return out


def measure(claims: list[RolloutClaim], ref: Reference) -> list[RolloutFigures]:
    """Single-version claims only (calibration generates them so)."""
    rows: list[RolloutFigures] = []
    by_version: dict[int, list[RolloutClaim]] = {}
    for c in claims:
        by_version.setdefault(c.versions[0], []).append(c)
    for v, group in by_version.items():
        outs = ref.prefill(v, [c.prompt_ids + c.token_ids[:-1] for c in group])
        for c, (logits, hidden) in zip(group, outs):
            n = len(c.token_ids)
            idx = torch.arange(len(c.prompt_ids) - 1, len(c.prompt_ids) - 1 + n)
            runs = decode_rollout_proof(c.proof, ref.hidden_size)
            commitments = [Commitment.from_bytes(b) for r in runs for b in r.chunks]
            stats = compare_blocks(chunk_blocks(hidden[idx], chunk_spans(c.versions)), commitments)
            toks = torch.tensor(c.token_ids)
            err = (torch.tensor(c.logprobs) - token_logprobs(logits[idx], toks, c.sampling.temperature)).abs()
            replay = ref.replay_sampling(logits[idx], c.sampling, [len(c.prompt_ids) + i for i in range(n)])
            flips = replay.tokens != toks
            rows.append(RolloutFigures(
                n, len(stats), max(s.exp_mismatches for s in stats), max(s.mant_err_mean for s in stats),
                max(s.mant_err_median for s in stats), float(err.max()), float(err.mean()), int(flips.sum()),
                float(replay.margins[flips].max()) if bool(flips.any()) else 0.0))
    return rows
