"""Why a verdict says what it says: the failure reasons and how strong each is as evidence.

Kept free of torch: the coordinator reads verdicts (verification/verdict.py) without running a model.
"""

from __future__ import annotations

from enum import Enum


class Severity(str, Enum):
    """How strong a failure is as evidence. PROOF: a deterministic check failed (prompt, reward,
    termination, versions, malformed input) or a numeric one failed far past its tolerance
    (`PROOF_FACTOR`); the coordinator bans on it. BORDERLINE: a numeric check failed near its
    tolerance (one or a few routing or numeric differences); the coordinator counts a strike."""

    NONE = "none"
    PROOF = "proof"
    BORDERLINE = "borderline"


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
    ENGINE_NOT_ALLOWED = "engine_not_allowed"
    ROUTES_MALFORMED = "routes_malformed"
    ROUTES_MISMATCH = "routes_mismatch"
    UNJUDGED = "unjudged"
    """The validator could not recompute the claim (it ran out of memory): no evidence either way, so the
    role gives its unit no verdict (offered again) and the submitter no strike (`Severity.NONE`)."""


PROOF_FACTOR = 2.0
"""A recomputation check failing by this factor or more past its threshold is proof of tampering;
nearer the line it is borderline (`Severity`)."""


def graded(excess: float) -> Severity:
    """Severity of a numeric failure, given the largest ratio of a statistic to its threshold."""
    return Severity.PROOF if excess >= PROOF_FACTOR else Severity.BORDERLINE
