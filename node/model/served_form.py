"""A policy version in its served form: what an FP8 run publishes after version 0.

An FP8 run serves its decoder projections (experts, or every projection) as block-scaled e4m3, so the
trainer publishes each of them that way (`X.weight` float8_e4m3fn beside `X.weight_scale_inv` float32 per
128 x 128 block: the Hugging Face / DeepSeek layout a quantised checkpoint has, node/model/quantization.py)
instead of in bf16: a Qwen3-30B-A3B version is 31 GB on the wire and on disk, not 61 GB (which does not fit
a GPU host's 64 GB disk beside the checkpoint). The trainer quantises each gathered tensor on its device
with the engines' own rule (node/fp8/quantize.py), one tensor at a time, and only where the blocks are the
served tensor's blocks: an expert's gate and up rows are stacked into one served tensor, so they go as e4m3
only when the gate's rows end on a block edge (Qwen3-30B-A3B: 768); other tensors go as they are.

Reading side: `ServedForm` is the version as a consumer of values reads every version, a mapping of HF
weight names to values in the run's dtype (`dequantize`: q x scale, block by block), with the scale tensors
hidden; `fp8(name)` gives a quantised tensor's bytes as they are. An FP8 module takes those bytes and scales
as they are (node/engine/fp8/model.py `_QuantizedWeights`): the engines through their staging
(node/engine/weight_staging.py: e4m3 bytes to the device, half a bf16 tensor's), the validator's resident
model through `InternalTensors.fp8`. Version 0 goes in its served form too: a member holding the run's
checkpoint makes the same bytes from it (node/roles/version0.py `ServedBytes`: the checkpoint's values
quantised by the same rule as they are read), so it checks version 0 against the signed manifest without
downloading it, and version 1 is a delta whose parent is that checkpoint (only the e4m3 bytes and scales an RL step moved travel). The spec's
pin covers the checkpoint's values: a member with the checkpoint checks it as it reads them; one without it
has the served bytes only, and the trainer's signature vouches for them (node/roles/common.py
`check_version0`).

Invariant: every FP8 module of every consumer of a version in its served form holds the trainer's e4m3
bytes and scales exactly (which are the bytes the same rule gives from the trainer's high-precision
weights), so the validator recomputes with the node's weights bit for bit; a tensor served in high
precision gets `ServedForm(v)[name]`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from torch import nn

from node.model.errors import MismatchedScales
from node.model.moe import GroupedExperts
from node.model.quantization import BLOCK, SCALE_SUFFIX, dequantize, scale_shape
from node.model.streamed_weights import IndexedTensors, headers
from protocol.model_spec import FP8Mode


def is_decoder_projection(name: str) -> bool:
    """A linear layer of a decoder layer other than its router: what FP8 `all` serves (node/engine/fp8) and
    FP8 training computes (node/rl/fp8) in e4m3."""
    return ".layers." in f".{name}" and not name.endswith("mlp.gate") and not name.endswith("lm_head")


def fp8_served_params(model: nn.Module, mode: FP8Mode) -> frozenset[str]:
    """Names of the parameters of a high-precision `model` that the serving precision `mode` holds in e4m3
    (`apply_fp8_mode`'s rule: the experts' stacked projections; with `all` every decoder projection too)."""
    if mode == "off":
        return frozenset()
    out: set[str] = set()
    for name, mod in model.named_modules():
        if isinstance(mod, GroupedExperts):
            out |= {f"{name}.gate_up_proj", f"{name}.down_proj"}
        elif mode == "all" and isinstance(mod, nn.Linear) and is_decoder_projection(name):
            out.add(f"{name}.weight")
    return frozenset(out)


def served_fp8(shape: tuple[int, ...], stacked_with_next: bool) -> bool:
    """Whether a tensor the run serves in FP8 goes in its served form: always, unless it is stacked with the
    next one in the served tensor (an expert's gate, then its up) and its rows do not end on a block edge."""
    return len(shape) == 2 and (not stacked_with_next or shape[0] % BLOCK == 0)


def is_served_form(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether a version holds quantised tensors (a scale tensor beside its weight)."""
    return any(name.endswith(SCALE_SUFFIX) for name in tensors)


class ServedForm(IndexedTensors):
    """HF weight name -> the value a consumer loads (a quantised weight dequantised into `dtype`); the scale
    tensors are not listed. Checked whole when made (`MismatchedScales` naming the tensor): every scale
    belongs to an e4m3 weight of its block shape, and every e4m3 weight has its scale."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype):
        self.tensors, self.dtype = tensors, dtype
        self.changes = getattr(tensors, "changes", None)
        """A delta's changed bytes in the published form (shardcast.changes.ChangedBytes), when fetched as one."""
        self.quantised: set[str] = set()
        self.index = {}
        heads = headers(tensors)  # a fetched payload's from its manifest: no tensor viewed
        for name, (shape, dt) in heads.items():
            if name.endswith(SCALE_SUFFIX):
                weight = name[: -len(SCALE_SUFFIX)]
                w = heads.get(weight)
                if w is None:
                    raise MismatchedScales(f"{name}: no weight {weight} beside it")
                if w[1] != torch.float8_e4m3fn:
                    raise MismatchedScales(f"{weight}: has {name} but is {w[1]}, not float8_e4m3fn")
                if dt != torch.float32 or tuple(shape) != scale_shape(tuple(w[0])):
                    raise MismatchedScales(f"{name}: {dt} {tuple(shape)}, expected float32 "
                                           f"{scale_shape(tuple(w[0]))} for {weight} {tuple(w[0])}")
                self.quantised.add(weight)
                continue
            if dt == torch.float8_e4m3fn and f"{name}{SCALE_SUFFIX}" not in heads:
                raise MismatchedScales(f"{name}: stored as float8_e4m3fn but {name}{SCALE_SUFFIX} is missing")
            self.index[name] = (tuple(shape), dtype if dt == torch.float8_e4m3fn else dt)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.index:
            raise KeyError(name)
        pair = self.fp8(name)
        return self.tensors[name] if pair is None else dequantize(*pair, self.dtype)

    def fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(e4m3 weight, float32 block scales) as published, or None for a tensor published in high precision."""
        if name not in self.quantised:
            return None
        return self.tensors[name], self.tensors[f"{name}{SCALE_SUFFIX}"]


def quantised_in(names) -> set[str]:  # noqa: ANN001 (an iterable of HF names)
    """The weights a version holds in e4m3: those with a scale tensor beside them."""
    return {n[: -len(SCALE_SUFFIX)] for n in names if n.endswith(SCALE_SUFFIX)}


def served(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> Mapping[str, torch.Tensor]:
    """A fetched version as its consumers read it: a `ServedForm` when it holds quantised tensors, else as is."""
    return ServedForm(tensors, dtype) if is_served_form(tensors) else tensors
