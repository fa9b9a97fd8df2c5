"""Publishing the trainer's weights without gathering the model: a version streams tensor by tensor
from the shards to rank 0's payload buffer while shardcast encodes the shards already complete.

Each parameter is gathered whole (FSDP all-gather, then EP all-gather: one tensor extra per rank
at a time, never the model), cast to the published dtype on the device, split into the HF tensors
`state_dict_to_hf` writes (experts unstacked) and copied device-to-host into rank 0's pinned
payload buffer without waiting (`non_blocking`); a thread waits for each tensor's copy (a CUDA
event) and hands the byte count written so far to `shardcast.publish.publish_stream`, whose pool
compresses and hashes every shard whose range is complete. So copies, compression and hashing
overlap, and the world is free for the next step as soon as the last copy is issued
(`Publication.gathered`): the encoding finishes on rank 0's threads while it trains.

The payload's layout is the one `shardcast.publish` gives `state_dict_to_hf(model)`, so
versions published either way are interchangeable (same names, order, dtypes, offsets). An FP8 run
publishes every version, 0 too, in its served form (`fp8`: each tensor the run serves in e4m3 quantised
on the device as it is gathered, beside its block scales: node/model/served_form.py).
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
import weakref
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import torch

from node.fp8.quantize import quantize_weight
from node.model.quantization import BLOCK, SCALE_SUFFIX, scale_shape
from node.model.served_form import fp8_served_params, served_fp8
from node.rl.parallel.dims import ParallelGroups
from node.rl.parallel.state import gather_tensors, global_shape
from protocol.identity import NodeKey
from protocol.model_spec import FP8Mode
from shardcast.codec import layout
from shardcast.manifest import SignedManifest
from shardcast.publish import PublishOptions, publish_stream
from shardcast.store import Store

log = logging.getLogger(__name__)

_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def hf_pieces(name: str, t: torch.Tensor, tied: bool = False, fp8: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one whole parameter (as `node.model.checkpoint.state_dict_to_hf`); `fp8`: a parameter
    the run serves in e4m3, in its served form where its blocks are the served tensor's (node/model/served_form.py):
    quantised whole (one call for a layer's stacked experts, every expert's blocks its own) and cut into pieces."""
    if tied and name == "lm_head.weight":
        return []
    m = _STACKED.match(name)
    gate_up = m is not None and m.group(2) == "gate_up_proj"
    q = s = None
    rows = (t.shape[-2] // 2 if gate_up else t.shape[-2]) if t.dim() >= 2 else 0
    if fp8 and rows and served_fp8((rows, t.shape[-1]), gate_up):
        q, s = _quantised(t)
    if not m:
        return [(name, t)] if q is None else [(name, q), (f"{name}{SCALE_SUFFIX}", s)]
    prefix, kind = m.groups()
    out = []
    for e in range(t.shape[0]):
        if gate_up:
            names = (f"{prefix}.{e}.gate_proj.weight", f"{prefix}.{e}.up_proj.weight")
            if q is None:
                out += list(zip(names, t[e].chunk(2, dim=0)))
            else:  # the gate's rows end on a block edge: its blocks and the up's are the stacked tensor's
                out += [(names[0], q[e, :rows]), (f"{names[0]}{SCALE_SUFFIX}", s[e, : rows // BLOCK]),
                        (names[1], q[e, rows:]), (f"{names[1]}{SCALE_SUFFIX}", s[e, rows // BLOCK :])]
        else:
            hf = f"{prefix}.{e}.down_proj.weight"
            out += [(hf, t[e])] if q is None else [(hf, q[e]), (f"{hf}{SCALE_SUFFIX}", s[e])]
    return out


def _quantised(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3, block scales) of `t` [..., N, K] where it is (shapes only for a meta tensor)."""
    if t.is_meta:
        return (torch.empty(t.shape, dtype=torch.float8_e4m3fn, device="meta"),
                torch.empty(scale_shape(tuple(t.shape)), dtype=torch.float32, device="meta"))
    return quantize_weight(t)


def hf_layout(model: torch.nn.Module, groups: ParallelGroups | None, dtype: torch.dtype | None,
              served: frozenset[str] = frozenset()) -> list:
    """The payload layout (shardcast `TensorEntry`s) of the model's HF tensors, from shapes alone (`served`:
    the parameters published in their served form)."""
    tied = model.config.tie_word_embeddings
    meta = {}
    for name, p in model.named_parameters():
        shape = p.shape if groups is None else global_shape(groups, name, p)
        for hf, t in hf_pieces(name, torch.empty(shape, dtype=dtype or p.dtype, device="meta"), tied, name in served):
            meta[hf] = t
    return layout(meta)[0]


class PayloadBuffer:
    """Rank 0's host buffer for a version's payload: pinned when CUDA is there (so the device-to-
    host copies run asynchronously at full speed), allocated once and reused version after
    version (padding between tensors stays zero)."""

    def __init__(self):
        self.tensor: torch.Tensor | None = None
        self.busy: Future | None = None
        """The publication still reading this buffer (the next one waits for it)."""
        self.wire: Future | None = None
        """The last publication's whole manifest: the next one's wire shards are encoded after its, while the next
        one is listed and announced (`publish_stream`'s `wire_after`)."""

    def get(self, total: int, pinned: bool) -> torch.Tensor:
        if self.busy is not None:
            wait([self.busy])  # done or failed: either way it no longer reads the buffer
        if self.tensor is None or self.tensor.numel() != total:
            self.tensor = None
            t0 = time.perf_counter()
            self.tensor = torch.zeros(total, dtype=torch.uint8, pin_memory=pinned)
            log.info("payload buffer: %.2f GB %s in %.2fs", total / 1e9, "pinned" if pinned else "pageable",
                     time.perf_counter() - t0)
        return self.tensor


class PublicationAborted(RuntimeError):
    """The weights stopped arriving mid-version (a failed gather): the version is not signed."""


@dataclass
class Publication:
    """One version on its way from rank 0's gathered weights into its shardcast store."""

    store: Store
    key: NodeKey
    """The trainer's key, which signs the manifest."""
    run_id: str
    version: int
    parent: int | None
    """The version a delta may be encoded against (None: a keyframe)."""
    options: PublishOptions | None
    buffer: PayloadBuffer
    """The pinned payload buffer the gathered tensors are copied into (reused across versions)."""
    done: Future = field(default_factory=Future)
    """Gets the local SignedManifest once the version is listed beside the publisher (processes sharing the
    store read it; the coordinator may announce it), or the error that stopped it."""
    whole: Future = field(default_factory=Future)
    """Gets the whole SignedManifest once the wire shards are listed too (peers elsewhere fetch it)."""
    fp8: FP8Mode = "off"
    """The run's serving precision: the tensors it serves in e4m3 are published so (version 0 is not: it is
    pinned by its values)."""


@dataclass
class Publishing:
    """A publication in flight (`shardcast.publish.publish_stream`'s two steps)."""

    listed: Future
    """The local SignedManifest: processes sharing the store read the version; announce it then."""
    whole: Future
    """The whole SignedManifest: peers elsewhere fetch it."""


def stream_publish(model: torch.nn.Module, groups: ParallelGroups | None, dtype: torch.dtype | None,
                   sink: Publication | None) -> float:
    """Every rank: gather the weights tensor by tensor (collective when `groups` is given).
    Rank 0 passes where they go (`sink`), and its encoding starts on a background thread;
    `sink.done` gets the SignedManifest (or the error). Returns the seconds spent gathering."""
    t0 = time.perf_counter()
    tied = model.config.tie_word_embeddings
    ready: queue.Queue = queue.Queue()
    served = frozenset() if sink is None else fp8_served_params(model, sink.fp8)
    if sink is not None:
        tensors = hf_layout(model, groups, dtype, served)
        total = tensors[-1].offset + tensors[-1].nbytes
        cuda = next(model.parameters()).is_cuda
        buf = sink.buffer.get(total, pinned=cuda)
        payload = buf.numpy()
        offsets = {e.name: e for e in tensors}

        def filled():
            while (item := ready.get()) is not None:
                if isinstance(item, BaseException):  # the gather failed: sign nothing
                    raise PublicationAborted("the gather stopped before every tensor was copied") from item
                event, n = item
                if event is not None:
                    event.synchronize()
                yield n

        after, sink.buffer.wire = sink.buffer.wire, sink.whole

        def encode():
            done, whole = sink.done, sink.whole
            try:  # `done` once the version is listed locally, `whole` once its wire shards are (retention after)
                publish_stream(sink.store, sink.key, sink.run_id, sink.version, tensors, payload, filled(), sink.parent,
                               sink.options, on_signed=done.set_result, wire_after=after, on_whole=whole.set_result)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiters
                if not done.done():
                    done.set_exception(exc)
                elif not whole.done():
                    log.warning("v%d: listed locally, then its wire shards failed: %s", sink.version, exc)
                else:
                    log.warning("v%d: published, then retention failed: %s", sink.version, exc)
                if not whole.done():
                    whole.set_exception(exc)

        sink.buffer.busy = sink.done  # step 2 reads the stored payload, not the buffer
        threading.Thread(target=encode, name=f"publish-v{sink.version}", daemon=True).start()
    failed: BaseException | None = None
    try:
        for name, whole in gather_tensors(model, groups):
            if sink is None:
                continue
            whole = whole.to(dtype) if dtype is not None else whole
            end = 0
            for hf, piece in hf_pieces(name, whole, tied, name in served):
                e = offsets[hf]
                src = piece.contiguous().reshape(-1).view(torch.uint8)
                buf[e.offset:e.offset + e.nbytes].copy_(src, non_blocking=src.is_cuda)
                end = e.offset + e.nbytes
            event = None
            if whole.is_cuda:
                event = torch.cuda.Event()
                event.record()
            if end:
                ready.put((event, end))
    except BaseException as exc:
        failed = exc
        raise
    finally:
        if sink is not None:
            ready.put(failed)
    return time.perf_counter() - t0


def publish_model(model: torch.nn.Module, groups: ParallelGroups | None, store: Store, key: NodeKey, run_id: str,
                  version: int, parent: int | None, options: PublishOptions | None, buffer: PayloadBuffer | None = None,
                  dtype: torch.dtype | None = None, fp8: FP8Mode = "off") -> SignedManifest:
    """One process (or rank 0 of a world whose other ranks call `stream_publish(..., None)`):
    publish `model` as `version` and wait for the whole signed manifest."""
    return start_publish(model, groups, store, key, run_id, version, parent, options, buffer, dtype, fp8).whole.result()


def start_publish(model: torch.nn.Module, groups: ParallelGroups | None, store: Store, key: NodeKey, run_id: str,
                  version: int, parent: int | None, options: PublishOptions | None, buffer: PayloadBuffer | None = None,
                  dtype: torch.dtype | None = None, fp8: FP8Mode = "off") -> Publishing:
    """`publish_model` that returns once every tensor's copy out of `model` is issued (the publication goes
    on on a thread)."""
    sink = Publication(store, key, run_id, version, parent, options, buffer or PayloadBuffer(), fp8=fp8)
    stream_publish(model, groups, dtype, sink)
    return Publishing(sink.done, sink.whole)


def publish_trainer(trainer, store: Store, key: NodeKey, run_id: str, version: int, parent: int | None,
                    options: PublishOptions | None = None, fp8: FP8Mode = "off") -> SignedManifest:
    """What the trainer role calls to publish a version: a one-process `Trainer` streams its own
    weights; a `world.Leader` has every rank of its world stream theirs. Returns the whole manifest.
    `fp8`: the run's serving precision (every version goes in its served form, version 0 too)."""
    return publish_trainer_async(trainer, store, key, run_id, version, parent, options, fp8).whole.result()


def publish_trainer_async(trainer, store: Store, key: NodeKey, run_id: str, version: int, parent: int | None,
                          options: PublishOptions | None = None, fp8: FP8Mode = "off",
                          dtype: torch.dtype | None = None) -> Publishing:
    """`publish_trainer` that returns once every tensor's copy out of the weights is issued: the next step
    may change the weights at once (on a GPU its kernels queue behind
    the copies on the same stream), while the version is encoded, signed and listed from the payload buffer
    (the next publication waits for the buffer: `PayloadBuffer.get`). `dtype`: a one-process trainer's version cast
    to it as it is copied out (a float32 master of a bf16 run; a world publishes in its own run's dtype)."""
    if hasattr(trainer, "send_weights_async"):
        return trainer.send_weights_async(store, key, run_id, version, parent, options, fp8)
    buffer = _buffers.setdefault(trainer, PayloadBuffer())  # pinned once per trainer, not per version
    return start_publish(trainer.model, None, store, key, run_id, version, parent, options, buffer, dtype=dtype, fp8=fp8)


_buffers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

