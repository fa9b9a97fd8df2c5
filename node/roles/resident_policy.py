"""The validator's policy versions with one resident model: the newest version's weights live in the
model on the validator's device; every other held version is one step of a chain, a delta against the
next newer held version (the positions where their raw tensors differ, with both values), so a version
is reached by applying the steps between it and the active one in place, and undone the same way.
Deltas stay on the model's GPU while it has room (at most `DEVICE_DELTAS_SHARE` of the model's bytes
there, and `DEVICE_FREE_FLOOR` left free for the roles sharing it), else on the host.

Why a chain: a newer version adds one step (the old newest against it) and touches nothing already
held. Session 14's 5.2B run held every version as a delta against the newest, so each new version
rebased every held delta; on the host that was two uploads and one download of each delta per version
held, 9-20 s per version, and the validator was the network's critical path.

Invariant: whichever version is active, the model's raw tensors (parameters and buffers, an FP8
model's e4m3 weights and block scales included) are bit for bit those a model loaded with that version
alone would hold, so judging is identical to keeping one model per version. A new version is read module
by module (one module's tensors copied at a time, never a second model) into a scratch copy of the module
beside the model, diffed, and its step applied to the model; one fetched as a delta of the newest held version
is not read at all: its step comes from the delta's changed bytes (`_step_from_changes`). RL steps in
bfloat16 change few elements: a step is sparse; a float32 model's steps change nearly all: then the
step holds the tensor whole (both versions' bits).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from node.engine.fp8.model import _QuantizedWeights
from node.engine.memory_plan import gpu_memory_stats
from node.engine.pinned_ring import PinnedRing, settle
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
    """Flat positions (int32, or int64 in a tensor of 2^31 elements or more); None: the whole tensor."""
    values: torch.Tensor
    """This version's bits at `index` (or all of them)."""
    resident: torch.Tensor
    """The next newer held version's bits at the same positions (or all of them)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.index, self.values, self.resident) if t is not None)


def _delta(own: torch.Tensor, newest: torch.Tensor, home) -> TensorDelta | None:  # noqa: ANN001
    """`own`'s bits against `newest`'s (flat, same device); None where they are equal. `home(nbytes)` says
    where the delta is kept."""
    changed = (own != newest).nonzero().squeeze(1)
    if changed.numel() == 0:
        return None
    # sparse: a flat position and two values per changed element; once that exceeds two copies of the
    # tensor, the delta holds it whole (both versions' bits)
    item, index = own.element_size(), _index_dtype(own.numel())
    sparse_bytes = changed.numel() * (torch.empty((), dtype=index).element_size() + 2 * item)
    if sparse_bytes > 2 * own.numel() * item:
        at = home(2 * own.numel() * item)
        return TensorDelta(None, own.to(at, copy=True), newest.to(at, copy=True))
    at = home(sparse_bytes)
    return TensorDelta(changed.to(index).to(at), own[changed].to(at), newest[changed].to(at))


def _apply(flat: torch.Tensor, d: TensorDelta, newer: bool = False) -> None:
    """Write the delta's own version's bits into `flat` (`newer`: the next newer version's)."""
    values = d.resident if newer else d.values
    if d.index is None:
        flat.copy_(values.to(flat.device))
    else:
        flat[d.index.to(flat.device)] = values.to(flat.device)


@dataclass
class PreparedVersion:
    """A version newer than every held one, its step computed (`ResidentPolicies.prepare`), not yet read in."""

    version: int
    manifest_hash: bytes
    internal: InternalTensors
    step: dict[str, TensorDelta]
    """The newest held version's tensors against this one (the step `commit` records for it)."""
    base: int
    """The newest held version when it was prepared (`commit` refuses it against another)."""
    prepare_s: float
    changed_bytes: int | None = None
    """The delta's changed bytes the step was built from (`ResidentPolicies.prepare`), None: read whole."""


class ResidentPolicies(Mapping):
    """version -> (the resident model switched to that version, its 32-byte manifest hash), as
    `node.replay.TorchReference` reads its policies. Looking a version up makes it the active one."""

    def __init__(self, model: CausalLM, version: int, manifest_hash: bytes):
        self.model, self.newest, self.active = model, version, version
        self.hashes: dict[int, bytes] = {version: manifest_hash}
        self.deltas: dict[int, dict[str, TensorDelta]] = {version: {}}
        """Each held version's step: its tensors against the next newer held version's (the newest: none)."""
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
        """Forget `version` (never the newest: its weights are the resident ones). A version between two
        held ones joins its step to the older one's."""
        if version == self.newest:
            raise ValueError(f"version {version} is the resident one")
        with self._lock:
            older = [v for v in self.hashes if v < version]
            if older:  # the older neighbour's step now spans to `version`'s newer neighbour
                below = max(older)
                self._activate(self._above(version))
                raw = raw_tensors(self.model)
                with torch.no_grad():
                    for name in {*self.deltas[below], *self.deltas[version]}:
                        newer = _bits(raw[name])
                        own = newer.clone()
                        for v in (version, below):
                            if name in self.deltas[v]:
                                _apply(own, self.deltas[v][name])
                        d = _delta(own, newer, self._home)
                        if d is None:
                            self.deltas[below].pop(name, None)
                        else:
                            self.deltas[below][name] = d
            elif self.active == version:
                self._activate(self._above(version))
            del self.hashes[version], self.deltas[version]

    def _above(self, version: int) -> int:
        """The next newer held version."""
        return min(v for v in self.hashes if v > version)

    @property
    def delta_bytes(self) -> int:
        """Bytes the steps hold, host and device."""
        return sum(self._held_bytes().values())

    def _held_bytes(self) -> dict[str, int]:
        """Bytes of the steps by where they are kept: {"cpu": ..., "cuda": ...}."""
        out: dict[str, int] = {}
        for t in (t for ds in self.deltas.values() for d in ds.values() for t in (d.index, d.values, d.resident)):
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
        """Walk the chain from the active version to `version`: down, each step's own bits; up, each
        step's newer bits (the steps of the versions from `version` up to the active one, newest first)."""
        if version == self.active:
            return
        raw = raw_tensors(self.model)
        held = sorted(self.hashes)
        lo, hi = sorted((version, self.active))
        steps = [v for v in held if lo <= v < hi]  # each from v to the next newer held version
        down = version < self.active
        with torch.no_grad():
            for v in (reversed(steps) if down else steps):
                for name, d in self.deltas[v].items():
                    _apply(_bits(raw[name]), d, newer=not down)
        self.active = version

    # ---- adding a version -------------------------------------------------------------------
    @property
    def at_newest(self) -> bool:
        """Whether the model holds the newest version (what `prepare` diffs against)."""
        return self.active == self.newest

    def add(self, version: int, state: Mapping[str, torch.Tensor], manifest_hash: bytes) -> None:
        """Hold `version` (HF-named tensors, checked as `load_hf_state_dict` checks them). A newer one
        becomes the resident weights and the old newest's step is its delta against it (`prepare` then
        `commit`, here with the model to the caller alone); an older one is read in over its next newer held
        version, diffed against it, and undone (the older neighbour's step is split at it)."""
        if version in self.hashes:
            return
        if version > self.newest:
            with self._lock:
                self._activate(self.newest)
            self.commit(self.prepare(version, state, manifest_hash))
            return
        with self._lock:
            t0, load_s = time.perf_counter(), 0.0
            base = self._above(version)
            below = max((v for v in self.hashes if v < version), default=None)
            self._activate(base)
            internal = self._checked(state)
            step: dict[str, TensorDelta] = {}  # `version` against base
            split: dict[str, TensorDelta] = {}  # the older neighbour's step, now against `version`
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
                        d = _delta(after, before[n], self._home)
                        if d is not None:
                            step[n] = d
                        if below is not None and (n in self.deltas[below] or d is not None):
                            older = before[n].clone()
                            if n in self.deltas[below]:
                                _apply(older, self.deltas[below][n])
                            if (sp := _delta(older, after, self._home)) is not None:
                                split[n] = sp
                        after.copy_(before[n])  # back to the base version's bits
            self.deltas[version] = step
            if below is not None:
                self.deltas[below] = split
            self.hashes[version] = manifest_hash
            self._log_held(version, time.perf_counter() - t0, load_s)

    def prepare(self, version: int, state: Mapping[str, torch.Tensor], manifest_hash: bytes) -> "PreparedVersion":
        """The first half of holding a version newer than every held one, with the model only read: its step
        (the newest version's bits against it), module by module, each read into a scratch copy of the module
        (as `commit` will read it into the model: the same bits, an FP8 module's quantisation included) and
        diffed against the model's. So judging rounds that recompute with the newest version may run
        meanwhile (`node.roles.model_turns.ModelTurns`): session 22's 5.2B network on one H200 had a round that
        asked 0.4 s after a hold began wait 4 s for it, and with it the trainer's next batch. The model must
        hold the newest version (`at_newest`) and nobody may switch it until `commit`. Refusals
        (`InvalidCheckpoint`) come before anything is read."""
        if version <= self.newest or not self.at_newest:
            raise ValueError(f"prepare v{version}: held up to v{self.newest}, active v{self.active}")
        t0 = time.perf_counter()
        internal = self._checked(state)
        with torch.no_grad():
            from_changes = self._step_from_changes(state)
        if from_changes is not None:
            step, changed = from_changes
            return PreparedVersion(version, manifest_hash, internal, step, self.newest, time.perf_counter() - t0, changed)
        step = {}
        seen: set[int] = set()
        with torch.no_grad():
            for module_name, mod, names in _modules_of(self.model, internal):
                own = {n: t for n, t in _own_raw(module_name, mod) if id(t) not in seen}
                seen.update(id(t) for t in own.values())
                if not own:  # a tied weight, diffed where it was first seen
                    continue
                prefix = module_name + "." if module_name else ""
                scratch = _scratch(mod)
                self._read_into(scratch, prefix, names, internal)
                new = dict(_own_raw(module_name, scratch))
                for n, t in own.items():
                    if (d := _delta(_bits(t), _bits(new[n]), self._home)) is not None:
                        step[n] = d
                del scratch, new
        return PreparedVersion(version, manifest_hash, internal, step, self.newest, time.perf_counter() - t0)

    def _step_from_changes(self, state: Mapping[str, torch.Tensor]) -> tuple[dict[str, TensorDelta], int] | None:
        """The step of a version fetched as a delta of the newest held one, from the delta's changed bytes alone
        (`shardcast.changes.ChangedBytes`, placed in the model's tensors as an engine places them: `SparseWrites`):
        the model's bits at the changed elements and those bits with the new bytes written in. None where the
        version is not such a delta, or a changed byte has no byte-exact place here (a plain tensor an FP8 module
        quantises on arrival): then the version is read whole. The model holds the parent's bytes exactly (the
        invariant), so this is the step the whole read finds, without moving the version's GB: session 38's
        validator took 2-7 s a 5.2B version reading it whole beside the judging, on the GPU every role shares."""
        changes = getattr(state, "changes", None)
        if changes is None or changes.parent != self.newest:
            return None
        from node.engine.weight_staging import SparseWrites
        from node.engine.weights import WeightsMismatch, expected_shapes, plan_weights

        try:
            writes = SparseWrites.of(self.model, plan_weights(state, self.model.config, expected_shapes(self.model)),
                                     state, changes)
        except WeightsMismatch:
            return None  # the whole read says what does not fit (`_checked` passed: it should not happen)
        if writes is None:
            return None
        names = {t.data_ptr(): (n, t) for n, t in reversed(list(raw_tensors(self.model).items()))}  # a tied one: first
        step: dict[str, TensorDelta] = {}
        for flat, pos, val in writes.writes:
            if flat.data_ptr() not in names:
                return None
            name, t = names[flat.data_ptr()]
            bits, size = _bits(t), t.element_size()
            pos = pos.long()
            elems = torch.unique(pos // size)  # sorted: the elements a changed byte is in
            own = bits[elems]
            newer = own.clone()
            newer.view(torch.uint8).view(-1, size)[torch.searchsorted(elems, pos // size), pos % size] = val
            moved = own != newer  # a byte the delta lists is changed; kept exact whatever it lists
            elems, own, newer = elems[moved], own[moved], newer[moved]
            if elems.numel() == 0:
                continue
            index = _index_dtype(bits.numel())
            sparse_bytes = elems.numel() * (torch.empty((), dtype=index).element_size() + 2 * size)
            if sparse_bytes > 2 * bits.numel() * size:  # as `_delta`: past two copies, both versions whole
                at = self._home(2 * bits.numel() * size)
                whole = bits.clone()
                whole[elems] = newer
                step[name] = TensorDelta(None, bits.to(at, copy=True), whole.to(at))
                continue
            at = self._home(sparse_bytes)
            step[name] = TensorDelta(elems.to(index).to(at), own.to(at), newer.to(at))
        return step, writes.bytes

    def commit(self, prepared: "PreparedVersion") -> None:
        """The second half, with the model to the caller alone: the newest version made active again (a round
        between the halves may have switched it), then its step applied upward, as `_activate` walks a chain: the
        version's bits where they differ (the step holds both sides, read into the scratch copies exactly as a
        read-in would have written them), nothing else touched. So the model is not read in a second time: the
        30B validator took a version of 31 GB in 11.0 s on an H100 reading it twice (session 25, a 0-byte step);
        what is left alone with the model is in proportion to what changed. The step recorded, the version the
        resident one."""
        with self._lock:
            if prepared.base != self.newest:
                raise ValueError(f"v{prepared.version} was prepared against v{prepared.base}; held up to "
                                 f"v{self.newest}")
            t0 = time.perf_counter()
            self._activate(self.newest)  # a round between the halves may have switched it
            raw = raw_tensors(self.model)
            with torch.no_grad():
                for name, d in prepared.step.items():
                    _apply(_bits(raw[name]), d, newer=True)
            load_s = time.perf_counter() - t0
            self.deltas[self.newest] = prepared.step
            self.newest = self.active = prepared.version
            self.deltas[prepared.version] = {}
            self.hashes[prepared.version] = prepared.manifest_hash
            self._log_held(prepared.version, prepared.prepare_s + load_s, load_s, prepared.prepare_s,
                           prepared.changed_bytes)

    def _checked(self, state: Mapping[str, torch.Tensor]) -> InternalTensors:
        internal = InternalTensors(state, self.model.config)  # each looked up when needed, module by module
        check_names(self.model, {n: shape for n, (shape, _) in internal.index.items()})
        internal.check_fp8()  # before anything is read in: a refused version leaves the held ones as they were
        return internal

    def _log_held(self, version: int, total_s: float, load_s: float, prepare_s: float | None = None,
                  changed_bytes: int | None = None) -> None:
        held = self._held_bytes()
        source = "" if changed_bytes is None else f" from its delta's {changed_bytes} changed bytes"
        log.info("version %d held in %.2f s (%s%.2f s %s): resident v%d, steps of %d versions "
                 "%.1f MiB on the device, %.1f MiB on the host %s", version, total_s,
                 "" if prepare_s is None else f"{prepare_s:.2f} s preparing its step{source} beside the judging, ",
                 load_s, "reading it into the model" if prepare_s is None else "applying the step to the model",
                 self.newest, len(self.deltas) - 1, held.get("cuda", 0) / (1 << 20),
                 held.get("cpu", 0) / (1 << 20), gpu_memory_stats(self._device) or "")

    def _read_into(self, mod: torch.nn.Module, prefix: str, names: list[str], internal: InternalTensors) -> None:
        """The module's tensors `names` from the version's (host) tensors: on a GPU through a pinned ring,
        several host copies at a time, in runs of the payload's mapping where they view one (`copy_many`: a
        layer's 384 expert tensors are ~20 runs, each one batched copy into its tensors' rows on the device), each
        HF tensor into its rows (no stacked copy on the host: that and pageable copies took 9-13 s of a 10 GB
        version, session 9's first 5.2B run); otherwise, and
        for an FP8 module (which quantises what it loads, or holds the e4m3 bytes and scales of a version in
        its served form as they are), through `load_state_dict`."""
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
                stream = torch.cuda.current_stream(self._device)  # in order after `before`'s clones
                settle(self._ring.copy_many(plan, stream))  # in 64 MiB runs of the payload (a layer's experts: ~20)
                return
        given: dict[str, torch.Tensor] = {}
        for n in names:
            raw = internal.fp8(n) if isinstance(mod, _QuantizedWeights) else None  # a version in its served form
            if raw is None:
                given[n[len(prefix):]] = _cast(mod, internal[n])
            else:
                given[n[len(prefix):]], given[n[len(prefix):] + "_scale"] = raw
        mod.load_state_dict(given, strict=False)


def raw_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `model` by name (an FP8 module's e4m3 weights and scales too)."""
    out: dict[str, torch.Tensor] = {}
    for module_name, mod in model.named_modules():
        out.update(_own_raw(module_name, mod))
    return out


def _own_raw(module_name: str, mod: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    prefix = module_name + "." if module_name else ""
    return [(prefix + n, t) for n, t in [*mod._parameters.items(), *mod._buffers.items()] if t is not None]


def _scratch(mod: torch.nn.Module) -> torch.nn.Module:
    """A copy of `mod` with its own parameters and buffers (clones, on their device) and everything else shared:
    what a version is read into beside the model (`ResidentPolicies.prepare`). Its children are the model's, and
    untouched: a module's load reads only its own names."""
    out = copy.copy(mod)
    out._parameters = {k: None if v is None else torch.nn.Parameter(v.detach().clone(), requires_grad=False)
                       for k, v in mod._parameters.items()}
    out._buffers = {k: None if v is None else v.clone() for k, v in mod._buffers.items()}
    return out


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
