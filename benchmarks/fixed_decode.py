"""A fixed batch of sequences that all start together, decoded greedily: the benchmarks' upper-bound
decode loop (`benchmarks.fp8_engine`'s decode figures, `benchmarks.gpu_engine`'s anchor), not a role
path. It runs the engine's own decode forward (`node.engine.forward.decode_step`) and captures it
with the engine's graph machinery (`node.engine.bucket_graphs.BucketGraphs`, one bucket: the batch),
but samples nothing and keeps no per-slot state: what `CudaEngine` adds on top of it is the price of
serving.

Invariant: replaying the graph computes what an eager step of the same tokens at the same positions
computes (same kernels, same shapes); `tests/fp8/test_kernels.py::test_cuda_graph_replay_equals_eager_decode`
pins it, and `tests/fp8/test_model_fp8.py::test_fixed_shape_decoder_matches_full_recompute` that the
loop continues a prompt as the model's full forward does.
"""

from __future__ import annotations

import torch

from node.engine.bucket_graphs import BucketGraphs
from node.engine.forward import decode_step, prefill_chunk
from node.model.cache import KVCache
from node.model.qwen3_moe import CausalLM


class FixedBatchDecoder:
    """Greedy or caller-driven decoding of `batch` sequences; row i lives in cache slot i, and slot
    `batch` is the scratch slot the graph's capture runs write (`BucketGraphs` padding rows)."""

    def __init__(self, model: CausalLM, batch: int, max_len: int, use_graph: bool = True):
        cfg = model.config
        p = next(model.parameters())
        self.model, self.batch, self.max_len = model, batch, max_len
        self.cache = KVCache(cfg.num_hidden_layers, batch + 1, cfg.num_key_value_heads, max_len, cfg.head_dim,
                             dtype=p.dtype, device=p.device)
        self.rows = torch.arange(batch, device=p.device)
        self.slots = self.rows.clone()
        """The slot table the step reads (pointed at the scratch slot while a capture runs)."""
        self.tokens = torch.zeros(batch, dtype=torch.long, device=p.device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=p.device)
        self.graphs = BucketGraphs(p.device, self._step_body, lambda b: self.slots.fill_(batch)) if use_graph else None
        self._captured = False

    def _step_body(self, b: int) -> torch.Tensor:
        hidden, _ = decode_step(self.model, self.cache, self.tokens, self.positions, self.slots)
        return self.model.lm_head(hidden)

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """Run the prompts [batch, T] (equal lengths) into the cache; return the last logits [batch, V]."""
        t = prompt_ids.shape[1]
        pos = torch.arange(t, device=prompt_ids.device).expand(self.batch, t)
        hidden, _ = prefill_chunk(self.model, prompt_ids, pos, self.cache, self.rows)
        return self.model.lm_head(hidden[:, -1])

    @torch.no_grad()
    def capture(self) -> None:
        """Compile every kernel and record the decode step (on the scratch slot: no row's cache changes)."""
        if self.graphs is not None and not self._captured:
            self.graphs.ensure(self.batch)
            self.slots.copy_(self.rows)
            self._captured = True

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed tokens [batch] at positions [batch]; return logits [batch, V] (graphed: a view, reused)."""
        self.tokens.copy_(tokens.view(-1))
        self.positions.copy_(positions.view(-1))
        if self.graphs is None:
            return self._step_body(self.batch)
        self.capture()
        return self.graphs.run(self.batch)

    def greedy(self, prompt_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy continuation [batch, new_tokens] of equal-length prompts."""
        t = prompt_ids.shape[1]
        if t + new_tokens > self.max_len:
            raise ValueError(f"prompt {t} + {new_tokens} new tokens exceed the cache's {self.max_len}")
        nxt = self.prefill(prompt_ids).argmax(-1)
        out = [nxt]
        for i in range(new_tokens - 1):
            pos = torch.full((self.batch,), t + i, device=nxt.device, dtype=torch.long)
            nxt = self.step(nxt, pos).argmax(-1)
            out.append(nxt)
        return torch.stack(out, dim=1)
