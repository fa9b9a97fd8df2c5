"""The checks TOPLOC lacks, plus the proof check, each a pure function of a claim and recomputation.

Every check returns None (pass) or a `Failure` naming the reason code and where it failed. Numeric
tolerances live here, named, with where they came from (verification/calibration/).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from verification.claim import RolloutClaim
from verification.hidden_check import ChunkStats, compare_blocks
from verification.proof import Commitment, ChunkSpan
from verification.reference import Reference

MAX_LOGPROB_ERR = 0.05
"""Largest |claimed - recomputed| logprob of one token (nats). Honest maximum measured in
calibration/thresholds.json (`logprob_abs_err`), with headroom for bf16 engines."""
MARGIN_NOISE = 0.05
"""A sampling decision is binding only where the validator's top-two perturbed-score margin exceeds
this; below it numerical noise may flip the choice. Calibration: `margin_of_flips` (honest flips)."""
REWARD_TOL = 1e-6
"""Rewards are exact functions of the transcript; only float formatting may differ."""


class Reason(str, Enum):
    OK = "ok"
    MALFORMED = "malformed"
    UNKNOWN_VERSION = "unknown_version"
    PROMPT_MISMATCH = "prompt_mismatch"
    TERMINATION = "bad_termination"
    REWARD_MISMATCH = "reward_mismatch"
    HIDDEN_MISMATCH = "hidden_mismatch"
    LOGPROB_MISMATCH = "logprob_mismatch"
    SAMPLING_MISMATCH = "sampling_mismatch"


@dataclass(frozen=True)
class Failure:
    reason: Reason
    detail: str
    chunk: int | None = None
    """Index of the failing proof chunk (rollout-wide, in token order)."""
    token: int | None = None
    """Index of the failing completion token."""


def turns(claim: RolloutClaim) -> list[tuple[int, int]]:
    """[start, end) of each model turn: maximal runs of sampled tokens."""
    out, mask, i = [], claim.sampled_mask, 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            out.append((i, j))
            i = j
        else:
            i += 1
    return out


def check_termination(claim: RolloutClaim, ref: Reference) -> Failure | None:
    """Every turn ends exactly where the engine's rule (EOS, stop token or string, length) ends it:
    not earlier (early stop) and not later (generation past a stop)."""
    sp, all_turns = claim.sampling, turns(claim)
    if not all_turns:
        return Failure(Reason.TERMINATION, "no sampled tokens")
    for t, (start, end) in enumerate(all_turns):
        last = t == len(all_turns) - 1
        for i in range(start, end):
            tok, n_turn = claim.token_ids[i], i - start + 1
            reason = None
            if tok == ref.eos_id:
                reason = "eos"
            elif tok in sp.stop_token_ids or (sp.stop_strings and any(
                    ref.decode(claim.token_ids[start : i + 1]).endswith(s) for s in sp.stop_strings)):
                reason = "stop"
            elif n_turn >= sp.max_new_tokens or len(claim.prompt_ids) + i + 1 >= ref.max_seq_len:
                reason = "length"
            if reason is None:
                continue
            if i != end - 1:
                return Failure(Reason.TERMINATION, f"turn {t} should have ended ({reason}) at token {i}", token=i)
            want = claim.finish_reason if last else "stop"
            if reason != want:
                return Failure(Reason.TERMINATION, f"turn {t} ended by {reason}, claimed {want}", token=i)
            break
        else:
            return Failure(Reason.TERMINATION, f"turn {t} stopped at token {end - 1} with no EOS, stop or limit",
                           token=end - 1)
    return None


def check_task(claim: RolloutClaim, ref: Reference) -> Failure | None:
    """The prompt is the task's, and the claimed reward is the environment's."""
    try:
        prompt = ref.prompt_ids(claim.env, claim.task_seed)
    except (KeyError, ValueError) as exc:
        return Failure(Reason.PROMPT_MISMATCH, f"unknown environment {claim.env!r}: {exc}")
    if prompt != claim.prompt_ids:
        return Failure(Reason.PROMPT_MISMATCH, "prompt differs from the task drawn from the seed")
    reward = ref.reward(claim.env, claim.task_seed, claim.token_ids)
    if abs(reward - claim.reward) > REWARD_TOL:
        return Failure(Reason.REWARD_MISMATCH, f"claimed reward {claim.reward}, recomputed {reward}")
    return None


def check_hidden(stats: list[ChunkStats], chunk_offset: int) -> Failure | None:
    for i, s in enumerate(stats):
        if not s.passes():
            return Failure(Reason.HIDDEN_MISMATCH, f"exp mismatches {s.exp_mismatches}, mantissa error mean "
                           f"{s.mant_err_mean:.2f} median {s.mant_err_median:.2f}", chunk=chunk_offset + i)
    return None


def check_segment(claim: RolloutClaim, ref: Reference, token_idx: list[int], logits: torch.Tensor,
                  hidden: torch.Tensor, spans: list[ChunkSpan], commitments: list[Commitment],
                  chunk_offsets: list[int]) -> Failure | None:
    """Checks of the sampled tokens `token_idx` of one version, given the validator's logits and
    hidden rows for them ([len(token_idx), V] and [len(token_idx), H], rows in token order).
    `spans` index into those rows; `chunk_offsets` give each span's rollout-wide chunk number."""
    from verification.proof import chunk_blocks

    stats = compare_blocks(chunk_blocks(hidden, spans), commitments)
    for s, off in zip(stats, chunk_offsets):
        if (f := check_hidden([s], off)) is not None:
            return f
    positions = [len(claim.prompt_ids) + i for i in token_idx]
    replay = ref.replay_sampling(logits, claim.sampling, positions)
    claimed_lp = torch.tensor([claim.logprobs[i] for i in token_idx], dtype=torch.float32)
    err = (claimed_lp - replay.logprobs.float()).abs()
    if bool((err > MAX_LOGPROB_ERR).any()):
        r = int(err.argmax())
        return Failure(Reason.LOGPROB_MISMATCH, f"claimed logprob {claimed_lp[r].item():.4f}, recomputed "
                       f"{replay.logprobs[r].item():.4f}", token=token_idx[r])
    claimed_tok = torch.tensor([claim.token_ids[i] for i in token_idx])
    bad = (replay.tokens != claimed_tok) & (replay.margins > MARGIN_NOISE)
    if bool(bad.any()):
        r = int(bad.nonzero()[0])
        return Failure(Reason.SAMPLING_MISMATCH, f"seeded sampling gives token {int(replay.tokens[r])} "
                       f"(margin {replay.margins[r].item():.3f}), claimed {int(claimed_tok[r])}", token=token_idx[r])
    return None
