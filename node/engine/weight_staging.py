"""A checked policy version on its way into a served model.

`StagedVersion.of(model, state_dict, shapes)` checks the version whole (`weights.plan_weights`), then:
- on a CUDA device with room for a second copy of the weights, stages it at once, in the caller's
  thread (the role's fetch, not the engine's), while the engine goes on decoding. A fetched payload
  (`shardcast.fetch.PayloadTensors`) is copied whole, its mapping in 64 MiB pieces through a ring of pinned host
  buffers (node/engine/pinned_ring.py: several host copies at a time, asynchronous host-to-device copies on a side
  stream), and each served tensor is then one view of that copy, or two (`MirrorPlan`, made once per payload
  layout): a 5.2B version is ~160 ring calls and no Python a tensor. Any other version (or a payload whose experts
  are out of order) is staged tensor by tensor, in runs of the mapping where its tensors view one (`copy_many`).
  `apply()`, between two decode steps, is then device-to-device copies into the served tensors (FP8 modules
  quantise theirs on the device, or, for a version in its served form, node/model/served_form.py, take its e4m3
  bytes and scales as they are);
- on the CPU, `apply()` copies each served tensor from its view of the payload's mapping (`MirrorPlan`), or each
  tensor straight into the served one; on a GPU without room for a staged copy (logged), tensor by tensor through
  the same pinned ring.
Either way no whole-model copy is made on the host: the payload's pages (or a version 0 read from the
member's checkpoint: node/model/streamed_weights.py) are read once, and experts land in their rows of the stacked
expert tensors where they are served.

Invariants: nothing served changes before `apply()` (a version refused by the check, or staged and
then replaced by a newer one, leaves the served weights as they were); `apply()` changes storage in
place, so captured CUDA graphs read the new weights without re-capture.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from node.engine.fp8.model import _QuantizedWeights
from node.engine.pinned_ring import CHUNK_BYTES, HOST_THREADS, PinnedRing, settle, shares_storage
from node.engine.weights import Target, WeightsMismatch, plan_weights
from node.model.checkpoint import InternalTensors, InvalidCheckpoint
from node.model.quantization import BLOCK, SCALE_SUFFIX, dequantize, scale_shape
from node.model.qwen3_moe import CausalLM
from node.model.served_form import ServedForm
from node.model.streamed_weights import headers
from shardcast.codec import dtype_of
from shardcast.fetch import PayloadTensors

log = logging.getLogger(__name__)

STAGING_HEADROOM = 1 << 30
"""Device memory left free beyond a staged copy (allocator slack, the next step's activations)."""


@dataclass
class SwapTimes:
    """Seconds spent on a version: staged (off the engine's thread) and applied (between two steps);
    `sparse_bytes`: bytes written where a delta's changes went in alone (`SparseWrites`), else 0;
    `ring_host_s` (`ring_host_cpu_s` of it running), `ring_wait_s`: the pinned ring's threads' seconds copying its
    pages into pinned buffers and waiting for buffers to leave for the device (`pinned_ring.RingSeconds`, summed
    over `ring_threads`)."""

    stage_s: float = 0.0
    apply_s: float = 0.0
    staged_on_device: bool = False
    bytes: int = 0
    sparse_bytes: int = 0
    ring_host_s: float = 0.0
    ring_host_cpu_s: float = 0.0
    ring_wait_s: float = 0.0
    ring_threads: int = 0


@dataclass
class SparseWrites:
    """A delta's changed bytes (`shardcast.changes.ChangedBytes`) placed in the served tensors: for each served
    tensor a delta changed, the byte positions in it and their new values, on its device. Written into a model
    that serves exactly the delta's parent, they make it serve the new version (the bytes the delta did not
    change are the parent's, which it holds): a few MB written where a whole copy moves GB.

    Only where every tensor the delta changed lands byte for byte in a served tensor: a plain tensor in one of its
    dtype, an e4m3 piece of a version in its served form (and its scales) in an FP8 module's buffers, each a
    contiguous range of its destination. A plain tensor an FP8 module quantises on arrival does not (its e4m3
    bytes are not the payload's): where the delta changed one, `of` gives None and the version is copied whole
    (one it did not change is the parent's, and so is what the module made of it)."""

    parent: int
    writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """(the served tensor's bytes, flat uint8; positions, int32 where they fit, else int64; values, uint8), on its
    device."""
    bytes: int

    @classmethod
    def of(cls, model: CausalLM, plan: dict[str, Target], state: Mapping[str, torch.Tensor],
           changes) -> SparseWrites | None:  # noqa: ANN001 (a ChangedBytes)
        import numpy as np

        changed = []  # (tensor entry, its changed bytes' range in `changes`)
        for e in changes.tensors:
            lo, hi = np.searchsorted(changes.positions, [e.offset, e.offset + e.nbytes])
            if hi > lo:
                changed.append((e, lo, hi))
        weights = {e.name.removesuffix(SCALE_SUFFIX) for e, _, _ in changed}  # a scale is placed with its weight
        placed = _byte_places(model, {n: plan[n] for n in weights if n in plan}, state)
        per_dest: dict[int, tuple[torch.Tensor, list, list]] = {}
        for e, lo, hi in changed:
            place = placed.get(e.name)
            if place is None or place[2] != e.nbytes:
                return None  # a changed tensor that has no byte-exact place
            whole, base, _ = place
            got = per_dest.setdefault(id(whole), (whole, [], []))
            got[1].append(changes.positions[lo:hi] - e.offset + base)
            got[2].append(changes.values[lo:hi])
        inside = sum(sum(len(p) for p in pos) for _, pos, _ in per_dest.values())
        if inside != len(changes.positions):
            return None  # a changed byte outside every tensor (padding is zeros in both): not this layout
        writes = []
        for whole, pos, val in per_dest.values():
            flat = whole.view(-1).view(torch.uint8)
            at = np.concatenate(pos)
            at = at.astype(np.int32) if flat.numel() < 2**31 else at  # half the bytes where they fit
            writes.append((flat, torch.from_numpy(at).to(flat.device), torch.from_numpy(np.concatenate(val)).to(flat.device)))
        return cls(changes.parent, writes, len(changes.positions))

    @torch.no_grad()
    def apply(self) -> None:
        for flat, pos, val in self.writes:
            flat.index_put_((pos,), val)


def _byte_places(model: CausalLM, plan: dict[str, Target],
                 state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int, int]]:
    """HF name (scales included) -> (the served tensor its bytes are in, byte offset there, byte length), for each
    tensor of `plan` (the ones a delta changed) that lands byte for byte (see `SparseWrites`; one that does not
    is left out)."""
    live = _served(model)
    published = state.tensors if isinstance(state, ServedForm) else state
    out: dict[str, tuple[torch.Tensor, int, int]] = {}
    for name, target in plan.items():
        whole = live.get(target.internal)
        if whole is None:
            continue
        pair = state.fp8(name) if isinstance(state, ServedForm) else None
        if pair is not None:
            scales = live.get(f"{target.internal}_scale")
            if whole.dtype != torch.float8_e4m3fn or scales is None:
                continue
            places = [(name, whole, target.view(whole)), (f"{name}{SCALE_SUFFIX}", scales, target.scale_view(scales))]
        elif _plain(whole) and whole.dtype == published[name].dtype:
            places = [(name, whole, target.view(whole))]
        else:  # quantised on arrival: its served bytes are not the published ones
            continue
        for hf, w, view in places:
            if w.is_contiguous() and view.is_contiguous():
                out[hf] = (w, view.data_ptr() - w.data_ptr(), view.numel() * view.element_size())
    return out


class Strided(NamedTuple):
    """A served tensor as a view of a payload's copy: its dtype, and shape, strides and offset in elements of it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def of(self, copy: torch.Tensor) -> torch.Tensor:
        """This view of `copy` (the payload's bytes, uint8, starting at its storage's first byte)."""
        size = self.dtype.itemsize
        return copy[: copy.numel() // size * size].view(self.dtype).as_strided(self.shape, self.stride, self.offset)


class Raw(NamedTuple):
    """A served tensor's e4m3 bytes and float32 block scales, as views of a payload's copy (a version in its served
    form)."""

    q: Strided
    scales: Strided


class Rows(list):
    """A stacked expert tensor given as ranges of its rows (dim 1), each (lo, hi, (e4m3, scales)): a version in its
    served form keeps each expert's gate scales between its gate and up bytes, so their rows are two views."""


@dataclass
class MirrorPlan:
    """How the served tensors are read from a fetched payload copied whole to the device: each one a single view of
    the copy (`Strided`), a stacked expert tensor too where its experts lie at one stride from each other in the
    payload (a trainer publishes each layer's experts in order), or two views (`Rows`: its gate rows and its up
    rows). So a version is staged as ~160 copies of 64 MiB, with no Python a tensor (`StagedVersion._stage_mirror`),
    and applied as before: a copy (or a quantisation) or two a served tensor, now from strided views.

    Made once per payload layout (`MirrorPlans`): the table of a version's tensors is the same version after version."""

    nbytes: int
    """Device bytes of the copy: the payload's, rounded up to 16."""
    parts: dict[str, list[tuple[tuple[int, int] | None, Strided | Raw]]]
    """Internal name -> [(rows or None for the whole tensor, its value or its e4m3 bytes and scales)]; a value is in
    the payload's dtype (a served tensor of another dtype converts as it is loaded)."""

    def views(self, copy: torch.Tensor) -> dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor] | Rows]:
        """What `apply` loads: internal name -> views of `copy` (a value, an (e4m3, scales) pair, or `Rows` of them)."""
        out: dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor] | Rows] = {}
        for internal, parts in self.parts.items():
            got = [(rows, (v.q.of(copy), v.scales.of(copy)) if isinstance(v, Raw) else v.of(copy)) for rows, v in parts]
            out[internal] = got[0][1] if got[0][0] is None else Rows((lo, hi, v) for (lo, hi), v in got)
        return out

    @classmethod
    def of(cls, plan: dict[str, Target], state: Mapping[str, torch.Tensor],
           shapes: dict[str, tuple[int, ...]]) -> MirrorPlan | None:
        """None where `state` is not a fetched payload (or a served form of one), or where some served tensor is not
        one view, or one view per row range, of it (its experts out of order: then the version is staged tensor by
        tensor)."""
        payload = _payload(state)
        if payload is None:
            return None
        entries = payload.entries
        short = [e.name for e in entries.values() if e.offset + e.nbytes > payload.payload.nbytes]
        if short:
            raise WeightsMismatch(f"tensors {short[:3]} lie beyond the payload's {payload.payload.nbytes} bytes")
        pieces: dict[str, list] = {}  # internal -> [(target, entry, its scales' entry or None)]
        for name, target in plan.items():
            raw = isinstance(state, ServedForm) and name in state.quantised  # (e4m3, scales) as published
            pieces.setdefault(target.internal, []).append(
                (target, entries[name], entries[f"{name}{SCALE_SUFFIX}"] if raw else None))
        parts = {}
        for internal, got in pieces.items():
            raw = got[0][2] is not None
            if any((p[2] is not None) != raw for p in got):
                return None
            whole = _one_view([(t, e) for t, e, _ in got], shapes[internal], Target.view)
            if whole is not None and raw:
                scales = _one_view([(t, sc) for t, _, sc in got], scale_shape(shapes[internal]), Target.scale_view)
                whole = None if scales is None else Raw(whole, scales)
            if whole is not None:
                parts[internal] = [(None, whole)]
                continue
            split = _row_views(got, shapes[internal])
            if split is None:
                return None
            parts[internal] = split
        return cls(-(-payload.payload.nbytes // 16) * 16, parts)


def _row_views(pieces: list, full: tuple[int, ...]) -> list | None:
    """A stacked expert tensor's (rows, e4m3 and scales views) per row range its pieces fill, or None (a tensor that
    comes in high precision and is no single view goes tensor by tensor: an FP8 module quantises it whole)."""
    by_rows: dict[tuple[int, int], list] = {}
    for target, e, sc in pieces:
        if target.expert is None or target.rows is None or sc is None:
            return None
        by_rows.setdefault(target.rows, []).append((Target(target.internal, target.expert), e, sc))
    out = []
    for (lo, hi), got in sorted(by_rows.items()):
        shape = (full[0], hi - lo, *full[2:])
        q = _one_view([(t, e) for t, e, _ in got], shape, Target.view)
        scales = _one_view([(t, sc) for t, _, sc in got], scale_shape(shape), Target.scale_view)
        if q is None or scales is None:
            return None
        out.append(((lo, hi), Raw(q, scales)))
    return out


def _one_view(pieces: list, full: tuple[int, ...], view) -> Strided | None:  # noqa: ANN001 (Target.view or .scale_view)
    """The one view of a payload's copy in which every (target, manifest entry) piece of a served tensor shaped
    `full` lies where its entry says, or None: the tensor contiguous from its first piece, or (stacked experts) each
    expert's pieces contiguous at one stride from the previous expert's. Checked on a meta tensor, piece by piece."""
    dtypes = {e.dtype for _, e in pieces}
    if len(dtypes) != 1:
        return None
    dtype = dtype_of(dtypes.pop())
    size = dtype.itemsize
    if any(e.offset % size for _, e in pieces):
        return None
    contiguous = [1] * len(full)
    for d in range(len(full) - 2, -1, -1):
        contiguous[d] = contiguous[d + 1] * full[d + 1]
    candidates = [(tuple(contiguous), min(e.offset for _, e in pieces) // size)]  # (strides, first element)
    experts: dict[int, int] = {}  # expert -> its first piece's byte offset
    for target, e in pieces:
        if target.expert is not None:
            experts[target.expert] = min(experts.get(target.expert, e.offset), e.offset)
    if 0 in experts and 1 in experts and experts[1] > experts[0]:
        candidates.append((((experts[1] - experts[0]) // size, *contiguous[1:]), experts[0] // size))
    for stride, first in candidates:
        meta = torch.empty_strided(full, stride, dtype=dtype, device="meta")
        for target, e in pieces:
            v = view(target, meta)
            if (not v.is_contiguous() or list(v.shape) != list(e.shape)
                    or (first + v.storage_offset()) * size != e.offset):
                break
        else:
            return Strided(dtype, tuple(full), tuple(stride), first)
    return None


class MirrorPlans:
    """An engine's `MirrorPlan`s by payload layout (the manifest's tensor table: name, dtype, shape, offset, size),
    the last few kept: a run publishes every version in one layout."""

    KEEP = 2

    def __init__(self) -> None:
        self._plans: dict[tuple, MirrorPlan | None] = {}

    def get(self, model: CausalLM, plan: dict[str, Target], state: Mapping[str, torch.Tensor],
            shapes: dict[str, tuple[int, ...]]) -> MirrorPlan | None:
        payload = _payload(state)
        if payload is None:
            return None
        key = (id(model), isinstance(state, ServedForm), payload.payload.nbytes,
               tuple((e.name, e.dtype, tuple(e.shape), e.offset, e.nbytes) for e in payload.entries.values()))
        if key not in self._plans:
            while len(self._plans) >= self.KEEP:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = MirrorPlan.of(plan, state, shapes)
            if self._plans[key] is None:
                log.warning("weights: a served tensor is no single view of this payload layout (experts out of "
                            "order?): its versions are staged tensor by tensor")
        return self._plans[key]


def _payload(state: Mapping[str, torch.Tensor]) -> PayloadTensors | None:
    """The fetched payload a version's tensors view (itself, or under its served form), else None."""
    inner = state.tensors if isinstance(state, ServedForm) else state
    return inner if isinstance(inner, PayloadTensors) else None


@dataclass
class StagedVersion:
    PATH = "mirror"
    """How a fetched payload is staged on a GPU: "mirror" (copied whole, `MirrorPlan`: session 34), "runs" (tensor by
    tensor, in runs of the payload through `PinnedRing.copy_many`: session 33) or "pieces" (a ring piece a tensor);
    `benchmarks.stage_speed` times each against the others. A version the mirror cannot serve goes by "runs"."""

    model: CausalLM
    state: Mapping[str, torch.Tensor]
    """HF-named tensors: views over a fetched payload's mapping, or a checkpoint read at each lookup
    (node/model/streamed_weights.py); each is looked up once, when it is copied."""
    plan: dict[str, Target]
    shapes: dict[str, tuple[int, ...]]
    ring: PinnedRing | None = None
    staged: dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]] | None = None
    """Internal name -> its value (or e4m3 and scales) once staged: a device copy, or a view of the payload's copy on
    the device or, on the CPU, of its mapping (`MirrorPlan`); None: `apply` copies from `state` tensor by tensor."""
    ready: torch.cuda.Event | None = None
    times: SwapTimes = field(default_factory=SwapTimes)
    sparse: SparseWrites | None = None
    """A delta's changes alone, for a model serving its parent (`apply(serving=parent)`)."""

    @classmethod
    def of(cls, model: CausalLM, state_dict: Mapping[str, torch.Tensor], shapes: dict[str, tuple[int, ...]],
           ring: PinnedRing | None = None, stage: bool = True, mirrors: MirrorPlans | None = None) -> StagedVersion:
        """Checked now (`WeightsMismatch`); staged on the device now when there is room for it (and `stage`:
        a model nobody serves yet, as the validator's, is better filled straight at `apply`). `mirrors`: the
        engine's plans for payloads copied whole (made once per payload layout)."""
        v = cls(model, state_dict, plan_weights(state_dict, model.config, shapes), shapes, ring)
        _check_served(v)
        published = state_dict.tensors if isinstance(state_dict, ServedForm) else state_dict  # as it travels
        v.times.bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in headers(published).values())
        changes = getattr(state_dict, "changes", None)  # a delta decoded against its parent (shardcast.fetch)
        if changes is not None:
            try:
                v.sparse = SparseWrites.of(model, v.plan, state_dict, changes)
            except torch.OutOfMemoryError:  # no room for the positions on the device: the version goes whole
                log.warning("weights: no device memory for a delta's %d changed bytes; copied whole", len(changes.positions))
                torch.cuda.empty_cache()
        device = _device(model)
        staging = device.type == "cuda" and stage and v.sparse is None  # (a delta's writes need no staged copy)
        mirror = None
        if cls.PATH == "mirror" and (device.type == "cpu" or staging):
            mirror = (mirrors or MirrorPlans()).get(model, v.plan, state_dict, shapes)
        if device.type == "cpu":  # the served tensors read straight from the payload's mapping, one view each
            if mirror is not None:
                v.staged = mirror.views(_payload(state_dict).base())
        elif staging:
            free, _ = torch.cuda.mem_get_info(device)
            free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # this process's cache
            if mirror is not None and mirror.nbytes + STAGING_HEADROOM <= free:
                v._stage_mirror(device, mirror)
                return v
            need = _staged_bytes(model, v.plan, shapes, state_dict)
            if cls.PATH != "pieces" and (ring is None or ring.dev_bufs is None):
                need += 2 * (ring.threads if ring is not None else HOST_THREADS) * CHUNK_BYTES  # its device buffers
            if need + STAGING_HEADROOM <= free:
                v._stage(device)
            else:
                log.warning("weights: no room to stage v on the device (needs %.2f GiB, %.2f GiB free): the swap "
                            "copies from pinned host memory between two decode steps (slower)", need / 2**30, free / 2**30)
        return v

    def _stage_mirror(self, device: torch.device, mirror: MirrorPlan) -> None:
        """The payload's mapping copied whole to the device through the pinned ring (64 MiB pieces: ~160 for a 5.2B
        version, and no Python a tensor), each served tensor then a view of that copy (`MirrorPlan`)."""
        t0 = time.perf_counter()
        if self.ring is None:
            self.ring = PinnedRing(device)
        src = _payload(self.state).base()
        copy = torch.empty(mirror.nbytes, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        copy.record_stream(stream)  # freed early (a newer version replaced it): not before the copies land
        self._settle(self.ring.copy(src, copy[: src.numel()], stream))
        self.ready = torch.cuda.Event()
        self.ready.record(stream)
        self.staged = mirror.views(copy)
        self.state = {}
        self.times.stage_s, self.times.staged_on_device = time.perf_counter() - t0, True

    def _stage(self, device: torch.device) -> None:
        t0 = time.perf_counter()
        live = _served(self.model)
        staged: dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = {}
        raw: dict[str, tuple] = {}
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # tensors handed over from this GPU are written
        pieces: list[Future] = []
        runs: list | None = [] if self.PATH != "pieces" else None  # (payload view, device destination) pairs: `copy_many`'s
        for name, target in self.plan.items():
            if self._copy_raw(name, target, raw, device, stream, pieces, runs):
                continue
            dst_full = staged.get(target.internal)
            if dst_full is None:
                dtype = _high_precision(self.model, target.internal, live)
                dst_full = staged[target.internal] = torch.empty(self.shapes[target.internal], dtype=dtype, device=device)
                dst_full.record_stream(stream)  # freed early (a newer version replaced it): not before the copies land
            self._copy(self.state[name], target.view(dst_full), stream, pieces, runs)
        if runs:
            pieces += self.ring.copy_many(runs, stream)
        for internal, bufs in raw.items():
            staged[internal] = self._finish_raw(bufs, stream, pieces)
        self._settle(pieces)
        self.ready = torch.cuda.Event()
        self.ready.record(stream)
        self.staged = staged
        self.state = {}  # the payload's pages are no longer needed
        self.times.stage_s, self.times.staged_on_device = time.perf_counter() - t0, True

    def _copy_raw(self, name: str, target: Target, raw: dict, device: torch.device,
                  stream: torch.cuda.Stream | None, pieces: list[Future], runs: list | None = None) -> bool:
        """For a tensor of a version in its served form (node/model/served_form.py): its e4m3 bytes into their
        place in a buffer of its whole served tensor on `device`, through the pinned ring to a GPU (half a bf16
        tensor's bytes; `runs`: left there for `PinnedRing.copy_many` where it views a larger storage), and its block scales into the whole
        tensor's scales on the host (a few bytes a piece: they go to the device at once, `_finish_raw`); an FP8
        module then holds both as they are (`_load`). False (nothing done) for any other tensor."""
        pair = self.state.fp8(name) if isinstance(self.state, ServedForm) else None
        if pair is None:
            return False
        bufs = raw.get(target.internal)
        if bufs is None:
            shape = self.shapes[target.internal]
            with torch.cuda.stream(stream) if stream is not None else _nothing():  # the stream that fills them
                bufs = raw[target.internal] = (torch.empty(shape, dtype=torch.float8_e4m3fn, device=device),
                                               torch.empty(scale_shape(shape), dtype=torch.float32, device=device),
                                               torch.empty(scale_shape(shape), dtype=torch.float32))
        target.scale_view(bufs[2]).copy_(pair[1])
        if device.type == "cuda":
            if self.ring is None:
                self.ring = PinnedRing(device)
            self._to_ring(pair[0], target.view(bufs[0]), stream, pieces, runs)
        else:
            target.view(bufs[0]).copy_(pair[0])
        return True

    def _finish_raw(self, bufs: tuple, stream: torch.cuda.Stream | None,
                    pieces: list[Future]) -> tuple[torch.Tensor, torch.Tensor]:
        """A served tensor's (e4m3, scales) once every piece was given to `_copy_raw`: its scales sent whole
        (the copies join `pieces`: settle them before the pair is read)."""
        q, scales, host = bufs
        if scales.device.type == "cuda":
            pieces += self.ring.copy(host, scales, stream)
        else:
            scales.copy_(host)
        return q, scales

    def _to_ring(self, src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream, pieces: list[Future],
                 runs: list | None) -> None:
        """dst <- src through the ring: left in `runs` for `PinnedRing.copy_many` where given and `src` views a larger
        storage (`pinned_ring.shares_storage`), else queued now (its pieces join `pieces`)."""
        if runs is not None and shares_storage(src):
            runs.append((src, dst))
        else:
            pieces += self.ring.copy(src, dst, stream)

    def _settle(self, pieces: list[Future]) -> None:
        """`settle`, the ring's seconds added to this version's `times`."""
        spent = settle(pieces)
        self.times.ring_host_s += spent.host_s
        self.times.ring_host_cpu_s += spent.host_cpu_s
        self.times.ring_wait_s += spent.wait_s
        self.times.ring_threads = self.ring.threads if self.ring is not None else 0

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream | None, pieces: list[Future],
              runs: list | None = None) -> None:
        """dst <- src, through the pinned ring when dst is on a GPU (a dtype change happens on the device);
        the ring's pieces join `pieces` (a dtype change waits for its own first); `runs`: a copy as it is of a
        view into a larger storage (`pinned_ring.shares_storage`) is left there for `PinnedRing.copy_many`."""
        if dst.device.type != "cuda" or src.device.type == "cuda":  # the CPU, or weights already on a GPU
            with torch.cuda.stream(stream) if stream is not None else _nothing():
                dst.copy_(src)
            return
        if self.ring is None:
            self.ring = PinnedRing(dst.device)
        if src.dtype == dst.dtype and dst.is_contiguous():
            self._to_ring(src, dst, stream, pieces, runs)
            return
        tmp = torch.empty(src.shape, dtype=src.dtype, device=dst.device)
        tmp.record_stream(stream)
        self._settle(self.ring.copy(src, tmp, stream))
        with torch.cuda.stream(stream):
            dst.copy_(tmp)  # the dtype change (or a strided destination) on the device

    @torch.no_grad()
    def apply(self, serving: int | None = None) -> None:
        """Into the served tensors, in place (between two decode steps, on the engine's thread). `serving`: the
        version the model holds now; where it is this delta's parent, only the changed bytes are written."""
        t0 = time.perf_counter()
        if self.sparse is not None and serving is not None and serving == self.sparse.parent:
            self.sparse.apply()
            if self.sparse.writes and self.sparse.writes[0][0].is_cuda:
                torch.cuda.current_stream(self.sparse.writes[0][0].device).synchronize()
            self.times.sparse_bytes, self.sparse, self.state = self.sparse.bytes, None, {}
            self.times.apply_s = time.perf_counter() - t0
            return
        self.sparse = None
        live = _served(self.model)
        if self.staged is not None:
            engine = torch.cuda.current_stream(_device(self.model)) if self.ready is not None else None
            if engine is not None:
                engine.wait_event(self.ready)
            recorded: set[int] = set()
            for internal, t in self.staged.items():
                _load(self.model, internal, t, live)
                for part in _tensors_of(t) if engine is not None else ():
                    if part.untyped_storage().data_ptr() not in recorded:  # (the mirror's views: one storage)
                        recorded.add(part.untyped_storage().data_ptr())
                        part.record_stream(engine)  # its memory is not reused before these copies have read it
        else:
            self._apply_direct(live)
        self.staged = None
        self.times.apply_s = time.perf_counter() - t0

    def _apply_direct(self, live: dict[str, torch.Tensor]) -> None:
        device = _device(self.model)
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        pending: dict[str, torch.Tensor] = {}  # quantised modules: one module's high-precision copy at a time
        raw: dict[str, tuple] = {}  # or its e4m3 copy and scales, for a version in its served form
        left: dict[str, int] = {}
        pieces: list[Future] = []
        for target in self.plan.values():
            left[target.internal] = left.get(target.internal, 0) + 1
        for name, target in self.plan.items():
            dest = live.get(target.internal)
            if self._copy_raw(name, target, raw, device, stream, pieces):
                left[target.internal] -= 1
                if not left[target.internal]:
                    pair = self._finish_raw(raw.pop(target.internal), stream, pieces)
                    self._settle(pieces)
                    _load(self.model, target.internal, pair, live)
                continue
            if dest is not None and _plain(dest):
                self._copy(self.state[name], target.view(dest), stream, pieces)
                continue
            buf = pending.get(target.internal)
            if buf is None:
                dtype = _high_precision(self.model, target.internal, live)
                buf = pending[target.internal] = torch.empty(self.shapes[target.internal], dtype=dtype, device=device)
            self._copy(self.state[name], target.view(buf), stream, pieces)
            left[target.internal] -= 1
            if not left[target.internal]:
                self._settle(pieces)  # the module's copy is whole before it is quantised
                _load(self.model, target.internal, pending.pop(target.internal), live)
        self._settle(pieces)
        self.state = {}


def _tensors_of(t: torch.Tensor | tuple | Rows) -> list[torch.Tensor]:
    """The tensors a staged value holds: itself, an (e4m3, scales) pair's, or every row range's."""
    if isinstance(t, Rows):
        return [x for _, _, v in t for x in _tensors_of(v)]
    return list(t) if isinstance(t, tuple) else [t]


def _check_served(v: StagedVersion) -> None:
    """A version in its served form: each served tensor comes wholly in e4m3 or wholly not, and e4m3 rows of
    a stacked tensor start and end on block edges (`WeightsMismatch` otherwise: nothing copied yet), the rule
    the validator's resident model applies too (`InternalTensors.check_fp8`)."""
    if not isinstance(v.state, ServedForm):
        return
    try:
        InternalTensors(v.state, v.model.config).check_fp8()
    except InvalidCheckpoint as exc:
        raise WeightsMismatch(str(exc)) from exc


def _nothing() -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _device(model: CausalLM) -> torch.device:
    return next(model.parameters()).device


def _served(model: CausalLM) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name (a tied weight under each of its names)."""
    return {**dict(model.named_buffers(remove_duplicate=False)), **dict(model.named_parameters(remove_duplicate=False))}


def _plain(t: torch.Tensor) -> bool:
    """A tensor served as it is loaded (an FP8 module's e4m3 buffer is loaded through its module)."""
    return t.dtype.itemsize >= 2


def _high_precision(model: CausalLM, internal: str, live: dict[str, torch.Tensor]) -> torch.dtype:
    t = live.get(internal)
    if t is not None and _plain(t):
        return t.dtype
    return model.get_submodule(internal.rpartition(".")[0]).dtype


def _load(model: CausalLM, internal: str, t: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
          live: dict[str, torch.Tensor]) -> None:
    """`internal` <- `t`: a value, or (e4m3, block scales) of a version in its served form, or `Rows` of them."""
    if isinstance(t, Rows):
        _load_rows(model, internal, t, live)
        return
    dest = live.get(internal)
    if dest is not None and _plain(dest):
        dest.copy_(dequantize(*t, dest.dtype) if isinstance(t, tuple) else t)
        return
    module_name, _, local = internal.rpartition(".")
    module = model.get_submodule(module_name)
    if not isinstance(module, _QuantizedWeights):
        raise TypeError(f"{internal}: neither a served tensor nor an FP8 module's weight")
    # a value is quantised on arrival, on the module's device; e4m3 with its scales is held as it is
    module.load_state_dict({local: t[0], f"{local}_scale": t[1]} if isinstance(t, tuple) else {local: t}, strict=False)


def _load_rows(model: CausalLM, internal: str, rows: Rows, live: dict[str, torch.Tensor]) -> None:
    """A stacked tensor given as (e4m3, scales) row ranges: each dequantised into its rows where the tensor is served
    as it is, or copied into an FP8 module's e4m3 bytes and scales as they are."""
    dest = live.get(internal)
    if dest is not None and _plain(dest):
        for lo, hi, pair in rows:
            _copy_rows(dest[:, lo:hi], dequantize(*pair, dest.dtype), internal)
        return
    module_name, _, local = internal.rpartition(".")
    module = model.get_submodule(module_name)
    if not isinstance(module, _QuantizedWeights):
        raise TypeError(f"{internal}: neither a served tensor nor an FP8 module's weight")
    q, scales = getattr(module, local), getattr(module, f"{local}_scale")
    for lo, hi, (vq, vs) in rows:
        _copy_rows(q[:, lo:hi], vq, internal)
        _copy_rows(scales[:, lo // BLOCK : hi // BLOCK], vs, internal)


def _copy_rows(dest: torch.Tensor, value: torch.Tensor, internal: str) -> None:
    if dest.shape != value.shape:  # (copy_ would broadcast)
        raise TypeError(f"{internal}: rows shaped {tuple(value.shape)} for {tuple(dest.shape)}")
    dest.copy_(value)


def _staged_bytes(model: CausalLM, plan: dict[str, Target], shapes: dict[str, tuple[int, ...]],
                  state: Mapping[str, torch.Tensor] | None = None) -> int:
    """Device bytes a staged copy of the version takes: a tensor that comes in its served form (`state` a
    `ServedForm`) is staged as its e4m3 bytes and float32 block scales (`_copy_raw`), any other in its high
    precision."""
    live = _served(model)
    raw = {t.internal for name, t in plan.items() if isinstance(state, ServedForm) and state.fp8(name) is not None}
    total = 0
    for internal in {t.internal for t in plan.values()}:
        n = math.prod(shapes[internal])
        if internal in raw:
            total += n + math.prod(scale_shape(shapes[internal])) * 4
        else:
            total += n * _high_precision(model, internal, live).itemsize
    return total
