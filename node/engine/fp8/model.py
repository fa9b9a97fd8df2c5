"""The engine's FP8 model path, applied from outside the model: `quantize_model_fp8(model)`.

Swaps every projection `nn.Linear` of the decoder layers for `FP8Linear` and every
`GroupedExperts` for `FP8GroupedExperts`. The embedding, the router gates, the norms and the LM
head stay in the model's dtype (they are small, or decide routing and logprobs directly).

Made on the meta device (`apply_fp8_mode` before allocation) the FP8 modules fill themselves from a
checkpoint with `fill_from` (node/model/fill.py), one tensor at a time: a block-scaled FP8 checkpoint's
own e4m3 bytes and scales go in as they are, a high-precision one is quantised per tensor on the
target device, so the high-precision model never exists whole beside the FP8 one.

Invariant: parameter names are unchanged. `load_state_dict` with ordinary high-precision
tensors under the usual HF names quantises them on arrival, so a new policy version fetched
through shardcast is served in FP8 by the same `engine.load_weights` call, without a restart;
`state_dict()` gives back dequantised tensors under the same names.
"""

from __future__ import annotations

import torch
from torch import nn

from node.fp8.ops import QuantizedRows, fp8_linear, grouped_linear, quantized_rows, swiglu
from node.fp8.quantize import BLOCK, dequantize_weight, quantize_weight
from node.model.moe import GroupedExperts, MoEBlock
from node.model.served_form import is_decoder_projection
from protocol.model_spec import FP8_MODES, FP8Mode


class _QuantizedWeights(nn.Module):
    """Holds e4m3 weights plus float32 block scales as buffers, named after the original params. Loads a
    high-precision weight by quantising it on arrival, or an e4m3 one given with its `<name>_scale` (a
    version in its served form: node/model/served_form.py) as it is."""

    names: tuple[str, ...] = ()

    def _set(self, name: str, w: torch.Tensor) -> None:
        q, s = quantize_weight(w.detach())
        setattr(self, name, q)
        setattr(self, name + "_scale", s)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001
        for name in self.names:
            destination[prefix + name] = dequantize_weight(
                getattr(self, name), getattr(self, name + "_scale")
            ).to(self.dtype)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,  # noqa: ANN001
                              unexpected_keys, error_msgs):
        for name in self.names:
            key = prefix + name
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
                continue
            w = state_dict[key]
            old, old_scale = getattr(self, name), getattr(self, name + "_scale")
            if tuple(w.shape) != tuple(old.shape):
                error_msgs.append(f"size mismatch for {key}: {tuple(w.shape)} vs {tuple(old.shape)}")
                continue
            raw = state_dict.get(key + "_scale")  # given in e4m3 with its block scales: held as it is
            if raw is not None:
                if w.dtype != torch.float8_e4m3fn or tuple(raw.shape) != tuple(old_scale.shape):
                    error_msgs.append(f"{key}: {w.dtype} with scales {tuple(raw.shape)}, expected float8_e4m3fn "
                                      f"with {tuple(old_scale.shape)}")
                    continue
                old.copy_(w)
                old_scale.copy_(raw)
                continue
            q, s = quantize_weight(w.to(old.device))
            old.copy_(q)
            old_scale.copy_(s)


class FP8Linear(_QuantizedWeights):
    """y = x W^T with W in e4m3, 128x128 block scales; x quantised per token per 128 channels."""

    names = ("weight",)

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("FP8Linear takes bias-free projections only")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.register_buffer("weight", torch.empty(0), persistent=False)
        self.register_buffer("weight_scale", torch.empty(0), persistent=False)
        self._set("weight", linear.weight)

    def prepared(self, x: torch.Tensor) -> QuantizedRows | torch.Tensor:
        """x [..., K] as `forward` takes it from several projections of one input (attention's q, k and v): its rows
        quantised once on the Triton path (`QuantizedRows` [M, K]; each projection's output is then [M, N]), else x."""
        return quantized_rows(x.reshape(-1, x.shape[-1]))

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale)

    def fill_from(self, prefix: str, source) -> None:  # noqa: ANN001 (node.model.fill.WeightSource)
        q, s = _quantized(source, f"{prefix}.weight", self.weight.device)
        self.weight.copy_(q)
        self.weight_scale.copy_(s)


class FP8GroupedExperts(_QuantizedWeights):
    """SwiGLU experts with both stacked projections in e4m3 and 128x128 block scales per expert."""

    names = ("gate_up_proj", "down_proj")

    def __init__(self, experts: GroupedExperts, top_k: int | None = None):
        super().__init__()
        self.num_experts = experts.num_experts
        self.top_k = top_k
        """Experts per token of the owning MoE block: bounds any expert's rows by the token count."""
        self.dtype = experts.gate_up_proj.dtype
        for name in self.names:
            self.register_buffer(name, torch.empty(0), persistent=False)
            self.register_buffer(name + "_scale", torch.empty(0), persistent=False)
            self._set(name, getattr(experts, name))

    def dispatchable(self, x: torch.Tensor) -> QuantizedRows | torch.Tensor:
        """The block's tokens quantised once, before `dispatch` copies each to its k experts (on the Triton path:
        the same e4m3 rows the product would make from each copy, from T rows instead of T x k)."""
        return quantized_rows(x)

    def forward(self, x_sorted: torch.Tensor | QuantizedRows, counts: torch.Tensor) -> torch.Tensor:
        cap = None if self.top_k is None else -(-x_sorted.shape[0] // self.top_k)
        gu = grouped_linear(x_sorted, counts, self.gate_up_proj, self.gate_up_proj_scale, capacity=cap)
        return grouped_linear(swiglu(gu), counts, self.down_proj, self.down_proj_scale, capacity=cap)

    def fill_from(self, prefix: str, source) -> None:  # noqa: ANN001 (node.model.fill.WeightSource)
        """Expert by expert: a checkpoint's gate and up blocks stacked as they are when the gate rows end on a
        block edge (Qwen3-30B-A3B: 768), else the pair requantised as one [2I, H] weight."""
        dev = self.down_proj.device
        for e in range(self.num_experts):
            gate, up = f"{prefix}.{e}.gate_proj.weight", f"{prefix}.{e}.up_proj.weight"
            stored = source.fp8(gate), source.fp8(up)
            if stored[0] is not None and stored[1] is not None and stored[0][0].shape[0] % BLOCK == 0:
                rows, blocks = stored[0][0].shape[0], stored[0][1].shape[0]  # gate's rows, then up's, each copied once
                self.gate_up_proj[e, :rows].copy_(stored[0][0])
                self.gate_up_proj[e, rows:].copy_(stored[1][0])
                self.gate_up_proj_scale[e, :blocks].copy_(stored[0][1])
                self.gate_up_proj_scale[e, blocks:].copy_(stored[1][1])
            else:
                q, s = quantize_weight(torch.cat([source.value(gate), source.value(up)]).to(dev))
                self.gate_up_proj[e].copy_(q)
                self.gate_up_proj_scale[e].copy_(s)
            q, s = _quantized(source, f"{prefix}.{e}.down_proj.weight", dev)
            self.down_proj[e].copy_(q)
            self.down_proj_scale[e].copy_(s)


def _quantized(source, name: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """`name` as e4m3 + block scales: the checkpoint's own when it stores it so, else quantised on `device`."""
    stored = source.fp8(name)
    return stored if stored is not None else quantize_weight(source.value(name).to(device))


@torch.no_grad()
def quantize_model_fp8(model: nn.Module, dense: bool = True) -> nn.Module:
    """Swap decoder projections (unless `dense` is False) and experts for FP8 twins, in place;
    returns the model. With dense=False only the experts are FP8: at decode batch sizes the
    attention projections are GEMMs of a few hundred rows, where bf16 cuBLAS beats block-scaled FP8."""
    swaps: list[tuple[str, nn.Module]] = []
    top_k = {f"{name}.experts": mod.top_k for name, mod in model.named_modules() if isinstance(mod, MoEBlock)}
    for name, mod in model.named_modules():
        if dense and isinstance(mod, nn.Linear) and is_decoder_projection(name):
            swaps.append((name, FP8Linear(mod)))
        elif isinstance(mod, GroupedExperts):
            swaps.append((name, FP8GroupedExperts(mod, top_k.get(name))))
    for name, new in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    return model




def place(model: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None) -> nn.Module:
    """`model.to(device, dtype)` that casts parameters only: an FP8 module's e4m3 weights and float32 scales
    are moved as they are (Module.to would cast them too, float8 being a floating-point dtype)."""
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                p.data = p.data.to(device=device, dtype=dtype if p.is_floating_point() else None)
        for name, b in mod._buffers.items():
            if b is not None:
                cast = dtype if b.is_floating_point() and not isinstance(mod, _QuantizedWeights) else None
                mod._buffers[name] = b.to(device=device, dtype=cast)
    return model


def apply_fp8_mode(model: nn.Module, mode: FP8Mode) -> nn.Module:
    """The run's serving precision applied to `model` in place: one rule for every engine and the
    validator (`experts`: routed experts only; `all`: every decoder projection and the experts; `off`:
    unchanged). Returns the model."""
    if mode not in FP8_MODES:
        raise ValueError(f"fp8 mode must be one of {', '.join(FP8_MODES)}, not {mode!r}")
    return model if mode == "off" else quantize_model_fp8(model, dense=mode == "all")


def fp8_mode_of(model: nn.Module) -> FP8Mode:
    """Which FP8 mode `model` is served in, read from its modules (inverse of `apply_fp8_mode`)."""
    mods = list(model.modules())
    if any(isinstance(m, FP8Linear) for m in mods):
        return "all"
    return "experts" if any(isinstance(m, FP8GroupedExperts) for m in mods) else "off"
