"""What a validator recomputes against, behind one small interface.

`verification` must not import the node's model or environments (dependency direction: only
`protocol`), so the node hands the validator a `Reference`: the claimed policy versions (prefill
and the seeded sampling rule), the tokenizer's end markers, and the environments.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from verification.claim import SamplingSpec


@dataclass
class Replay:
    """The validator's own sampling decisions at some positions."""

    tokens: torch.Tensor  # [N] long
    logprobs: torch.Tensor  # [N] log_softmax(logits / T)[token]
    margins: torch.Tensor  # [N] top-1 minus top-2 perturbed score


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T)[token] per row, the engine's reported logprob (T = 0 counts as 1)."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


class Reference(ABC):
    eos_id: int
    """Token that ends a turn."""
    max_seq_len: int
    """Engine sequence limit (prompt + completion), also a length stop."""
    hidden_size: int
    """Width of the final hidden states the proofs commit to."""
    vocab_size: int
    """Token ids must lie below this."""
    precision: str
    """Engine precision the run prescribes: its dtype ("float32", "bfloat16"), or "fp8-<mode>-<dtype>"
    ("fp8-experts-bfloat16", ...) when it serves block-scaled FP8 weights on that base dtype; picks the
    thresholds (verification/checks.py `THRESHOLDS`)."""
    shape: str | None = None
    """The served architecture (`verification.pooled.shape_of`): picks a shape's own pooled bounds where they
    were calibrated (`POOLED_BY_SHAPE`); None: the precision's."""

    @abstractmethod
    def manifest_hash(self, version: int) -> bytes | None:
        """32-byte manifest hash of `version`, or None if the validator does not hold it."""

    @abstractmethod
    def prefill(self, version: int, sequences: list[list[int]], with_routes: bool = False,
                with_router_logits: bool = False, logits_from: list[int] | None = None,
                replay: list[torch.Tensor] | None = None) -> list[tuple]:
        """(logits [T, V], final hidden [T, H]) of each full sequence under `version`'s weights (with
        `logits_from`, sequence i's logits only from position logits_from[i] on: [T - logits_from[i], V],
        what the checks need of a real vocabulary's logits: the completion's rows, not the prompt's); with
        `with_routes`, a third element: the experts chosen [T, moe_layers, k] (None: dense model); with
        `with_router_logits` too, a fourth: the router logits [T, moe_layers, E] float32 that chose them
        (a Reference that cannot give them returns three elements: the routing check then counts every
        differing pair, near-ties included). `replay`: per sequence, the experts [T, moe_layers, k] to
        route to instead of the router's choice (the router logits are still this router's)."""

    @abstractmethod
    def prefill_mixed(self, sequence: list[int], segments: list[tuple[int, int, int]],
                      with_routes: bool = False, with_router_logits: bool = False, logits_from: int = 0,
                      replay: torch.Tensor | None = None, free_before: int = 0) -> tuple:
        """(logits [T - logits_from, V], hidden [T, H]) of one sequence whose positions [start, end) of each
        (version, start, end) segment were computed by that version, attending to the keys and values
        the earlier segments' versions wrote (an in-flight sequence keeps its KV cache across a swap);
        with `with_routes`, a third and fourth element as in `prefill`; `replay` as there, for the one sequence,
        except in segments that end at or before `free_before` (routed by the router: a later turn's prefill
        of positions an earlier pass computed)."""

    def prefill_mixed_many(self, items: list[tuple[list[int], list[tuple[int, int, int]], int, torch.Tensor | None]],
                           with_routes: bool = False, with_router_logits: bool = False) -> list[tuple]:
        """`prefill_mixed` of each (sequence, segments, logits_from, replay), the same results in order. A
        Reference whose versions share one model switched in place computes them version by version
        (node/replay.py); this one, each sequence in turn."""
        return [self.prefill_mixed(seq, segments, with_routes, with_router_logits, start, replay)
                for seq, segments, start, replay in items]

    def decode_routes(self, data: bytes, positions: int) -> torch.Tensor:
        """Claimed route bytes -> [positions, moe_layers, k] for this model; raise ValueError when
        they cannot be this model's routes of that many positions (length, expert id)."""
        raise ValueError("this reference does not read routed experts")

    @abstractmethod
    def replay_sampling(self, logits: torch.Tensor, sampling: SamplingSpec, positions: list[int]) -> Replay:
        """The seeded sampling rule applied to rows of `logits` [N, V] at absolute `positions`."""

    def measure_tokens(self, logits: list[torch.Tensor], samplings: list[SamplingSpec], positions: list[list[int]],
                       claimed: list[list[int]]) -> list[tuple[torch.Tensor, Replay]]:
        """Per segment i (its recomputed `logits[i]` [n_i, V], its request's sampling, the tokens' absolute
        positions and the claimed tokens): (log_softmax(logits / T)[claimed] [n_i], the seeded rule's
        `Replay` there), all on the host. This one segment at a time; a Reference that can measure many
        segments in one pass over their rows overrides it (node/replay.py `TorchReference`)."""
        out = []
        for x, spec, pos, toks in zip(logits, samplings, positions, claimed):
            lp = token_logprobs(x, torch.tensor(toks, device=x.device), spec.temperature)
            r = self.replay_sampling(x, spec, pos)
            out.append((lp.cpu(), Replay(r.tokens.cpu(), r.logprobs.cpu(), r.margins.cpu())))
        return out

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of token ids (for stop strings)."""

    @abstractmethod
    def prompt_ids(self, env: str, task_seed: int) -> list[int]:
        """Prompt tokens of the task `env` draws from `task_seed`; raise KeyError for an unknown env."""

    @abstractmethod
    def reward(self, env: str, task_seed: int, completion_ids: list[int]) -> float:
        """The environment's reward for a completion of that task."""
