"""The validator's policy versions with one resident model: the newest version's weights live in the
model on the validator's device; every other version is held as a delta against it (the positions
where that version's raw tensors differ, with both values), and is applied in place when a claim needs
it, then undone. Deltas stay on the model's GPU while it has room (at most `DEVICE_DELTAS_SHARE` of the
model's bytes there, and `DEVICE_FREE_FLOOR` left free for the roles sharing it), else on the host:
on the host, adding a 10 GB version took 25-40 s of pageable copies each way (session 7's 5.2B run,
where the validator was the network's critical path).

Invariant: whichever version is active, the model's raw tensors (parameters and buffers, an FP8
model's e4m3 weights and block scales included) are bit for bit those a model loaded with that version
alone would hold, so judging is identical to keeping one model per version. A new version is read into
the model module by module (one module's tensors copied at a time, never a second model), and every
held delta is rebased onto it, so deltas span at most the versions still judged (RL steps in bfloat16
change few elements: sparse; a float32 model's steps change nearly all: then a tensor is held whole).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from node.engine.fp8.model import _QuantizedWeights
from node.engine.weight_staging import PinnedRing, settle
from node.model.checkpoint import InternalTensors, InvalidCheckpoint
from node.model.qwen3_moe import CausalLM

log = logging.getLogger(__name__)

DEVICE_DELTAS_SHARE = 2.0
"""Deltas kept on the GPU hold at most this many times the model's own bytes (about k + 2 versions of
bfloat16 RL steps; more go to the host)."""
DEVICE_FREE_FLOOR = 16 << 30
"""A delta goes to the host rather than leave the GPU with less than this free (the validator's own
prefill, and the trainer and inference node that may share the device)."""


def _index_dtype(numel: int) -> torch.dtype:
    """Flat positions as int32 where they fit (4 bytes a changed element instead of 8)."""
    return torch.int32 if numel < 2**31 else torch.int64

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t` flattened as integers of its element size: exact comparison and copies for every dtype (FP8 too)."""
    return t.detach().view(_INT[t.element_size()]).reshape(-1)


@dataclass
class TensorDelta:
    """Where one version's raw tensor differs from the resident (newest) version's."""

    index: torch.Tensor | None
    """Flat positions (int32, or int64 in a tensor of 2^31 elements or more; host); None: `values` is the whole tensor."""
    values: torch.Tensor
    """This version's bits at `index` (or all of them)."""
    resident: torch.Tensor | None
    """The newest version's bits at `index` (None when whole: `ResidentPolicies._whole` holds them)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.index, self.values, self.resident) if t is not None)


def _delta(own: torch.Tensor, newest: torch.Tensor, home) -> TensorDelta | None:  # noqa: ANN001
    """`own`'s bits against `newest`'s (flat, same device); None where they are equal. `home(nbytes)` says
    where the delta is kept."""
    changed = (own != newest).nonzero().squeeze(1)
    if changed.numel() == 0:
        return None
    # sparse: a flat position and two values per changed element; once that exceeds the tensor's own
    # bytes, the delta holds the tensor whole
    item, index = own.element_size(), _index_dtype(own.numel())
    sparse_bytes = changed.numel() * (torch.empty((), dtype=index).element_size() + 2 * item)
    if sparse_bytes > own.numel() * item:
        return TensorDelta(None, own.to(home(own.numel() * item), copy=True), None)
    at = home(sparse_bytes)
    return TensorDelta(changed.to(index).to(at), own[changed].to(at), newest[changed].to(at))


def _apply(flat: torch.Tensor, d: TensorDelta) -> None:
    if d.index is None:
        flat.copy_(d.values.to(flat.device))
    else:
        flat[d.index.to(flat.device)] = d.values.to(flat.device)


class ResidentPolicies(Mapping):
    """version -> (the resident model switched to that version, its 32-byte manifest hash), as
    `node.replay.TorchReference` reads its policies. Looking a version up makes it the active one."""

    def __init__(self, model: CausalLM, version: int, manifest_hash: bytes):
        self.model, self.newest, self.active = model, version, version
        self.hashes: dict[int, bytes] = {version: manifest_hash}
        self.deltas: dict[int, dict[str, TensorDelta]] = {version: {}}
        self._whole: dict[str, torch.Tensor] = {}
        """The newest version's bits of each tensor some delta holds whole (where `_home` put them)."""
        self._lock = threading.Lock()
        self._device = next(model.parameters()).device
        self._ring: PinnedRing | None = None
        self._model_bytes = sum(t.numel() * t.element_size() for t in raw_tensors(model).values())

    # ---- Mapping ----------------------------------------------------------------------------
    def __getitem__(self, version: int) -> tuple[CausalLM, bytes]:
        if version not in self.hashes:
            raise KeyError(version)
        self.activate(version)
        return self.model, self.hashes[version]

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.hashes))

    def __len__(self) -> int:
        return len(self.hashes)

    def __contains__(self, version: object) -> bool:
        return version in self.hashes

    def drop(self, version: int) -> None:
        """Forget `version` (never the newest: its weights are the resident ones)."""
        if version == self.newest:
            raise ValueError(f"version {version} is the resident one")
        with self._lock:
            if self.active == version:
                self._activate(self.newest)
            del self.hashes[version], self.deltas[version]
            self._drop_unused_whole()

    @property
    def delta_bytes(self) -> int:
        """Bytes the deltas hold (with the newest version's copies of tensors held whole), host and device."""
        return sum(self._held_bytes().values())

    def _held_bytes(self) -> dict[str, int]:
        """Bytes of deltas (and whole copies) by where they are kept: {"cpu": ..., "cuda": ...}."""
        out: dict[str, int] = {}
        parts = [t for ds in self.deltas.values() for d in ds.values() for t in (d.index, d.values, d.resident)]
        for t in [*parts, *self._whole.values()]:
            if t is not None:
                out[t.device.type] = out.get(t.device.type, 0) + t.numel() * t.element_size()
        return out

    def _home(self, nbytes: int) -> torch.device:
        """Where a delta of `nbytes` is kept: the model's GPU while it has room (see the module docstring)."""
        if self._device.type != "cuda":
            return torch.device("cpu")
        free, _ = torch.cuda.mem_get_info(self._device)
        on_device = self._held_bytes().get("cuda", 0)
        if on_device + nbytes <= DEVICE_DELTAS_SHARE * self._model_bytes and free - nbytes >= DEVICE_FREE_FLOOR:
            return self._device
        return torch.device("cpu")

    # ---- switching --------------------------------------------------------------------------
    def activate(self, version: int) -> None:
        """Make the model hold `version`'s weights (in place)."""
        with self._lock:
            self._activate(version)

    def _activate(self, version: int) -> None:
        if version == self.active:
            return
        raw = raw_tensors(self.model)
        with torch.no_grad():
            for name, d in self.deltas[self.active].items():  # back to the newest
                flat = _bits(raw[name])
                if d.index is None:
                    flat.copy_(self._whole[name].to(flat.device))
                else:
                    flat[d.index.to(flat.device)] = d.resident.to(flat.device)
            for name, d in self.deltas[version].items():
                _apply(_bits(raw[name]), d)
        self.active = version

    # ---- adding a version -------------------------------------------------------------------
    def add(self, version: int, state: Mapping[str, torch.Tensor], manifest_hash: bytes) -> None:
        """Hold `version` (HF-named tensors, checked as `load_hf_state_dict` checks them): a newer one
        becomes the resident weights and every held delta is rebased onto it; an older one is read in,
        diffed, and undone."""
        with self._lock:
            t0, load_s = time.perf_counter(), 0.0
            self._activate(self.newest)
            internal = InternalTensors(state, self.model.config)  # each looked up once, module by module
            check_names(self.model, {n: shape for n, (shape, _) in internal.index.items()})
            newer = version > self.newest
            raw = raw_tensors(self.model)
            changes: dict[str, TensorDelta] = {}  # newer: the old newest against `version`; else `version` against newest
            seen: set[int] = set()
            with torch.no_grad():
                for module_name, mod, names in _modules_of(self.model, internal):
                    own = {n: t for n, t in _own_raw(module_name, mod) if id(t) not in seen}
                    seen.update(id(t) for t in own.values())
                    before = {n: _bits(t).clone() for n, t in own.items()}
                    prefix = module_name + "." if module_name else ""
                    t = time.perf_counter()
                    self._read_into(mod, prefix, names, internal)
                    load_s += time.perf_counter() - t
                    for n, t in own.items():
                        after = _bits(t)
                        d = _delta(before[n], after, self._home) if newer else _delta(after, before[n], self._home)
                        if newer:
                            self._rebase(n, after, d)
                        else:
                            after.copy_(before[n])  # back to the newest version's bits
                        if d is not None:
                            changes[n] = d
            if newer:
                self.deltas[self.newest] = changes
                self.newest = self.active = version
                self.deltas[version] = {}
            else:
                self.deltas[version] = changes
            self.hashes[version] = manifest_hash
            self._refresh_whole(raw)
            held = self._held_bytes()
            log.info("version %d held in %.2f s (%.2f s reading it into the model): resident v%d, deltas of %d versions "
                     "%.1f MiB on the device, %.1f MiB on the host", version, time.perf_counter() - t0, load_s,
                     self.newest, len(self.deltas) - 1, held.get("cuda", 0) / (1 << 20), held.get("cpu", 0) / (1 << 20))

    def _read_into(self, mod: torch.nn.Module, prefix: str, names: list[str], internal: InternalTensors) -> None:
        """The module's tensors `names` from the version's (host) tensors: on a GPU through a pinned ring,
        several host copies at a time and each HF tensor straight into its rows (no stacked copy on the host:
        that and pageable copies took 9-13 s of a 10 GB version, session 9's first 5.2B run); otherwise, and
        for an FP8 module (which quantises what it loads), through `load_state_dict`."""
        if self._device.type == "cuda" and not isinstance(mod, _QuantizedWeights):
            plan = []
            for n in names:
                dest = getattr(mod, n[len(prefix):]).data
                for at, src in internal.pieces(n):
                    view = dest[at] if at else dest
                    if src.device.type != "cpu" or src.dtype != view.dtype or not view.is_contiguous() or \
                            src.shape != view.shape:
                        plan = None
                        break
                    plan.append((src, view))
                if plan is None:
                    break
            if plan is not None:
                if self._ring is None:
                    self._ring = PinnedRing(self._device)
                stream, pieces = torch.cuda.current_stream(self._device), []  # in order after `before`'s clones
                for src, view in plan:
                    pieces += self._ring.copy(src, view, stream)
                settle(pieces)
                return
        mod.load_state_dict({n[len(prefix):]: _cast(mod, internal[n]) for n in names}, strict=False)

    def _rebase(self, name: str, newest: torch.Tensor, step: TensorDelta | None) -> None:
        """Re-express every held version's delta of tensor `name` against `newest` (the version being
        added, already in the model), the previous newest's bits given by `step` (None: unchanged)."""
        for v, ds in self.deltas.items():
            if v == self.newest or (name not in ds and step is None):
                continue
            full = newest.clone()
            if step is not None:
                _apply(full, step)
            if name in ds:
                _apply(full, ds[name])
            d = _delta(full, newest, self._home)
            if d is None:
                ds.pop(name, None)
            else:
                ds[name] = d

    def _refresh_whole(self, raw: dict[str, torch.Tensor]) -> None:
        needed = {n for ds in self.deltas.values() for n, d in ds.items() if d.index is None}
        self._whole = {}  # the newest version's bits changed: copied again (the old copies freed first)
        for n in needed:
            self._whole[n] = _bits(raw[n]).to(self._home(raw[n].numel() * raw[n].element_size()), copy=True)

    def _drop_unused_whole(self) -> None:
        needed = {n for ds in self.deltas.values() for n, d in ds.items() if d.index is None}
        self._whole = {n: t for n, t in self._whole.items() if n in needed}


def raw_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `model` by name (an FP8 module's e4m3 weights and scales too)."""
    out: dict[str, torch.Tensor] = {}
    for module_name, mod in model.named_modules():
        out.update(_own_raw(module_name, mod))
    return out


def _own_raw(module_name: str, mod: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    prefix = module_name + "." if module_name else ""
    return [(prefix + n, t) for n, t in [*mod._parameters.items(), *mod._buffers.items()] if t is not None]


def _modules_of(model: torch.nn.Module, internal: dict[str, torch.Tensor]):
    """(module name, module, the internal names it loads), for every module owning some of them."""
    by_module: dict[str, list[str]] = {}
    for n in internal:
        by_module.setdefault(n.rpartition(".")[0], []).append(n)
    return [(m, model.get_submodule(m), names) for m, names in by_module.items()]


def _cast(mod: torch.nn.Module, t: torch.Tensor) -> torch.Tensor:
    """An FP8 module quantises what it loads: from the model's dtype, as `apply_fp8_mode` does after a load."""
    return t.to(mod.dtype) if isinstance(mod, _QuantizedWeights) else t


def check_names(model: torch.nn.Module, internal: dict[str, tuple[int, ...]]) -> None:
    """Every tensor the model loads present with its shape, nothing else (`InvalidCheckpoint`), read from
    the modules (an FP8 model's `state_dict()` would dequantise a copy of every weight)."""
    own: dict[str, tuple[int, ...]] = {}
    for module_name, mod in model.named_modules():
        prefix = module_name + "." if module_name else ""
        if isinstance(mod, _QuantizedWeights):
            own.update({prefix + n: tuple(getattr(mod, n).shape) for n in mod.names})
            continue
        own.update({prefix + n: tuple(p.shape) for n, p in mod._parameters.items() if p is not None})
        own.update({prefix + n: tuple(b.shape) for n, b in mod._buffers.items()
                    if b is not None and n not in mod._non_persistent_buffers_set})
    missing, unexpected = sorted(set(own) - set(internal)), sorted(set(internal) - set(own))
    if missing or unexpected:
        raise InvalidCheckpoint(f"missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    for n, shape in internal.items():
        if tuple(shape) != own[n]:
            raise InvalidCheckpoint(f"{n}: shape {tuple(shape)} in checkpoint, model expects {own[n]}")
