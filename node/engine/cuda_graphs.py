"""Decode steps captured in CUDA graphs, for a fixed batch of sequences that all start together: the
benchmarks' decode loop (`benchmarks.fp8_engine`, `benchmarks.gpu_engine`: the model's own forward per
step, no slots, no sampling). The engine serves with `cuda_engine` and `bucket_graphs` instead.

A decode step of a small-batch MoE is hundreds of small kernels; launched one by one from Python
they cost far more than the bytes they move. A CUDA graph replays the whole step with one launch.
What makes the model's step capturable: a KV cache whose reads have a fixed length (the attention
mask, built from positions on the device, hides the unwritten tail), expert counts computed
without host synchronisation (node.model.moe.expert_counts), and kernels compiled before capture.

Invariant: replaying the graph computes exactly what an eager forward of the same tokens at the
same positions computes (same kernels, same shapes);
`tests/fp8/test_kernels.py::test_cuda_graph_replay_equals_eager_decode` pins it.
"""

from __future__ import annotations

import torch

from node.model.cache import KVCache
from node.model.qwen3_moe import CausalLM


class StaticKVCache(KVCache):
    """A cache whose slot i belongs to batch row i and whose reads always span max_len positions."""

    def write_and_read(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
                       k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.write(layer, slots, positions, k_new, v_new)
        return self.k[layer].transpose(1, 2), self.v[layer].transpose(1, 2)


class GraphDecoder:
    """Greedy or caller-sampled decoding of `batch` sequences with a captured decode step."""

    def __init__(self, model: CausalLM, batch: int, max_len: int, use_graph: bool = True):
        cfg = model.config
        p = next(model.parameters())
        self.model, self.batch, self.max_len, self.use_graph = model, batch, max_len, use_graph
        self.cache = StaticKVCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len,
                                   cfg.head_dim, dtype=p.dtype, device=p.device)
        self.slots = torch.arange(batch, device=p.device)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=p.device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=p.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """Run the prompts [batch, T] (equal lengths) into the cache; return last logits [batch, V]."""
        t = prompt_ids.shape[1]
        pos = torch.arange(t, device=prompt_ids.device).expand(self.batch, t)
        return self.model(prompt_ids, pos, self.cache, self.slots).logits[:, -1]

    def _forward_static(self) -> torch.Tensor:
        return self.model(self.tokens, self.positions, self.cache, self.slots).logits[:, 0]

    @torch.no_grad()
    def capture(self, warmup: int = 2) -> None:
        """Compile every kernel on a side stream, then record one decode step."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self._forward_static()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward_static()

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed tokens [batch] at positions [batch]; return logits [batch, V] (a view, reused)."""
        self.tokens.copy_(tokens.view(-1, 1))
        self.positions.copy_(positions.view(-1, 1))
        if self.use_graph:
            if self.graph is None:
                self.capture()
            self.graph.replay()
            return self.logits
        return self._forward_static()

    @torch.no_grad()
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
