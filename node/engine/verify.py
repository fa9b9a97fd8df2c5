"""The validator's batched prefill on the engine's device: many rollouts recomputed at once, and
only what the checks need leaves the forward pass.

For each (prompt + completion) sequence, one prefill (no KV cache: causal flash attention over
right-padded batches of similar length, bounded by `batch_tokens`), then at every row that
produced a completion token: the final hidden state (the proof's input), the log-probability of
the claimed token under the request's temperature, and the seeded rule's own choice there
(`device_sampling`), all from LM-head logits computed `lm_rows` rows at a time and never
copied to the host. A full [T, V] logits tensor per rollout (what `Reference.prefill` returns)
would be 0.6 MB per token at a 151,936-token vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from node.engine.device_sampling import sample_device, sample_torch, seed_row, token_logprobs
from node.engine.forward import prefill_chunk
from node.engine.sampling import SamplingParams
from node.model.batching import right_pad, token_budget_groups
from node.model.qwen3_moe import CausalLM


@dataclass
class PrefillCheck:
    """Recomputed quantities at the completion rows of one sequence (tensors on the model's device)."""

    logprobs: torch.Tensor
    """[n] log_softmax(logits / T)[claimed token] at each completion token."""
    tokens: torch.Tensor
    """[n] the seeded rule's choice at each completion token (greedy when T = 0)."""
    hidden: torch.Tensor
    """[n, H] final hidden states of the rows that produced the completion tokens."""
    routes: torch.Tensor | None
    """[len - 1, n_moe_layers, k] experts each fed position was routed to (with_routes only)."""


@torch.inference_mode()
def verify_prefill(model: CausalLM, sequences: list[list[int]], prompt_lens: list[int],
                   params: list[SamplingParams], with_routes: bool = False, batch_tokens: int = 32768,
                   lm_rows: int = 4096) -> list[PrefillCheck]:
    """Recompute every sequence (prompt_lens[i] prompt tokens, then the completion) under `model`."""
    device = next(model.parameters()).device
    for s, p in zip(sequences, prompt_lens):
        if not 0 < p < len(s):
            raise ValueError(f"prompt length {p} must lie inside a sequence of {len(s)} tokens")
    out: list[PrefillCheck | None] = [None] * len(sequences)
    for members in token_budget_groups([len(s) for s in sequences], batch_tokens):
        for i, check in zip(members, _group(model, [sequences[i] for i in members], [prompt_lens[i] for i in members],
                                            [params[i] for i in members], with_routes, lm_rows, device)):
            out[i] = check
    return out  # type: ignore[return-value]


def _group(model: CausalLM, seqs: list[list[int]], plens: list[int], params: list[SamplingParams],
           with_routes: bool, lm_rows: int, device: torch.device) -> list[PrefillCheck]:
    ids = right_pad(seqs).to(device)
    t = ids.shape[1]
    hidden, routes = prefill_chunk(model, ids, torch.arange(t, device=device).expand(len(seqs), t))
    # completion rows: row j of sequence r predicts token j + 1, for j in [plen - 1, len - 1)
    rows_r = np.concatenate([np.full(len(s) - p, r) for r, (s, p) in enumerate(zip(seqs, plens))])
    rows_j = np.concatenate([np.arange(p - 1, len(s) - 1) for s, p in zip(seqs, plens)])
    targets = torch.from_numpy(np.concatenate([s[p:] for s, p in zip(seqs, plens)]).astype(np.int64)).to(device)
    temps = torch.from_numpy(np.concatenate([np.full(len(s) - p, q.temperature, dtype=np.float32)
                                             for s, p, q in zip(seqs, plens, params)])).to(device)
    seeds = torch.from_numpy(np.concatenate([seed_row(q.seed, p, len(s) - p) if q.temperature > 0
                                             else np.zeros(len(s) - p, dtype=np.int64)
                                             for s, p, q in zip(seqs, plens, params)])).to(device)
    top_p = [q.top_p for s, p, q in zip(seqs, plens, params) for _ in range(len(s) - p)]
    h = hidden[torch.from_numpy(rows_r).to(device), torch.from_numpy(rows_j).to(device)]
    lp = torch.empty(h.shape[0], dtype=torch.float32, device=device)
    tok = torch.empty(h.shape[0], dtype=torch.long, device=device)
    for a in range(0, h.shape[0], lm_rows):
        b = min(a + lm_rows, h.shape[0])
        logits = model.lm_head(h[a:b])
        if any(p < 1 for p in top_p[a:b]):
            tok[a:b], _, lse = sample_torch(logits, temps[a:b], seeds[a:b], torch.tensor(top_p[a:b], device=device))
        else:
            tok[a:b], _, lse = sample_device(logits, temps[a:b], seeds[a:b])
        lp[a:b] = token_logprobs(logits, temps[a:b], lse, targets[a:b])
    out, k = [], 0
    for r, (s, p) in enumerate(zip(seqs, plens)):
        n = len(s) - p
        out.append(PrefillCheck(lp[k : k + n], tok[k : k + n], h[k : k + n],
                                routes[r, : len(s) - 1] if with_routes and routes is not None else None))
        k += n
    return out
