"""Device-side state of the CUDA engine's slots, and how its model is placed and quantised.

`SlotState` holds, per cache slot, what a decode step reads (last token, next position,
temperature, the seed of every position) and what a completion is read from at the end
(log-probability, final hidden state and routed experts by position). Every update is a
scatter indexed by device tensors, so the decode step that makes it can be captured in a graph.
"""

from __future__ import annotations

import torch

from node.engine.core import Request
from node.engine.device_sampling import sample_device, sample_torch, seed_row
from node.model.config import ModelConfig
from node.model.qwen3_moe import CausalLM


class FP8Unsupported(RuntimeError):
    """FP8 asked for on a device without e4m3 tensor cores (compute capability below 8.9)."""


def prepare_model(model: CausalLM, device: str | torch.device | None, dtype: torch.dtype | None,
                  fp8: bool | str) -> CausalLM:
    """Move the model to `device` (CUDA: bf16 unless `dtype` is given) and swap in FP8 modules."""
    if device is not None:
        from node.engine.fp8.model import place

        device = torch.device(device)
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else None)
        model = place(model, device, dtype)  # a model made in FP8 keeps its e4m3 weights and scales
    if fp8:
        if fp8 not in (True, "all", "experts"):
            raise ValueError(f"fp8 must be False, True/'all' or 'experts', not {fp8!r}")
        dev = next(model.parameters()).device
        if dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9):
            raise FP8Unsupported(f"{torch.cuda.get_device_name(dev)} has no FP8 tensor cores (compute capability "
                                 f"{torch.cuda.get_device_capability(dev)}); run without fp8")
        from node.engine.fp8.model import quantize_model_fp8

        quantize_model_fp8(model, dense=fp8 != "experts")
    return model


class SlotState:
    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, dtype: torch.dtype, device: torch.device,
                 capture_hidden: bool, capture_experts: bool):
        z = dict(device=device)
        self.max_len = max_len
        self.last_tok = torch.zeros(slots, dtype=torch.long, **z)
        self.pos = torch.zeros(slots, dtype=torch.long, **z)
        """Position of the next token fed to the model (= sequence length - 1)."""
        self.temp = torch.ones(slots, dtype=torch.float32, **z)
        self.seeds = torch.zeros(slots, max_len, dtype=torch.int64, **z)
        """token_seed(request seed, p) for the positions p a request may sample."""
        self.logp = torch.zeros(slots, max_len, dtype=torch.float32, **z)
        """Log-probability of the token at each position (generated positions only)."""
        self.hidden = torch.zeros(slots, max_len if capture_hidden else 1, cfg.hidden_size, dtype=dtype, **z)
        """Final hidden state at each position fed to the model (the row that chose the next token)."""
        self.capture_hidden = capture_hidden
        n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        rdtype = torch.uint8 if cfg.num_experts <= 256 else torch.int16
        self.routes = (torch.zeros(slots, max_len, n_moe, cfg.num_experts_per_tok, dtype=rdtype, **z)
                       if capture_experts and n_moe else None)

    def admit(self, slot: int, request: Request) -> None:
        p, plen = request.params, len(request.prompt_ids)
        self.temp[slot] = p.temperature
        if p.temperature > 0:
            count = min(p.max_new_tokens, self.max_len - plen)
            self.seeds[slot, plen : plen + count].copy_(torch.from_numpy(seed_row(p.seed, plen, count)))

    def sample_first(self, slots: torch.Tensor, plen: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor,
                     top_ps: list[float]) -> None:
        """Sample each admitted sequence's first token from its last prompt row."""
        temps, seeds = self.temp[slots], self.seeds[slots, plen]
        if any(p < 1 for p in top_ps):
            tok, lp, _ = sample_torch(logits, temps, seeds, torch.tensor(top_ps, device=logits.device))
        else:
            tok, lp, _ = sample_device(logits, temps, seeds)
        self.last_tok[slots] = tok
        self.pos[slots] = plen
        self.logp[slots, plen] = lp
        if self.capture_hidden:
            self.hidden[slots, plen - 1] = hidden

    def record(self, slots: torch.Tensor, pos: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor,
               hidden: torch.Tensor, routes: torch.Tensor | None, scratch: int) -> None:
        """Scatter one decode step's results; the scratch slot (padding rows) stays at position 0."""
        self.last_tok[slots] = tok
        self.pos[slots] = torch.where(slots == scratch, torch.zeros_like(pos), pos + 1)
        self.logp[slots, pos + 1] = lp
        if self.capture_hidden:
            self.hidden[slots, pos] = hidden
        if routes is not None and self.routes is not None:
            self.routes[slots, pos] = routes.to(self.routes.dtype)

    def resample_top_p(self, slots: torch.Tensor, logits: torch.Tensor, rows: list[int], top_ps: list[float],
                       tok_out: torch.Tensor) -> None:
        """Redo the choice of `rows` (those with top_p < 1) with the nucleus mask."""
        idx = torch.tensor(rows, device=logits.device)
        s = slots[idx]
        pos = self.pos[s]
        tp = torch.tensor([top_ps[i] for i in rows], device=logits.device)
        tok, lp, _ = sample_torch(logits[idx], self.temp[s], self.seeds[s, pos], tp)
        self.last_tok[s] = tok
        self.logp[s, pos] = lp
        tok_out[idx] = tok
