"""Version 0 from the member's own copy of the run's checkpoint, not again over shardcast.

The spec names version 0's source (a directory every member holds, or the seeded tiny model) and may
pin its hash; the trainer publishes it as any version. A member that can build it locally fetches
only the signed manifest (a few KB) and uses its own weights when they are exactly what was published:
the same names, dtypes and shapes, and every shard's raw hash equal to the manifest's (a trainer that
warmed the model up first publishes other weights, and then the member fetches them as usual). An FP8
run publishes version 0 in its served form (node/model/served_form.py): the member quantises its
checkpoint's values by the same rule as it reads them (`ServedBytes`) and compares those bytes.

A checkpoint is never loaded whole for this: the check reads it shard by shard in payload order
(`shardcast.codec.matches_manifest` over `StreamedWeights`, hashing the spec's pin in the same pass),
and what it returns is the checkpoint read tensor by tensor when a loader asks
(node/model/streamed_weights.py), a mapping of HF names to tensors as a fetched version is, which
every loader takes the same way. The tiny seeded model has no files: it is built in memory (it is
small) and handed over through the same mapping.

Invariant: a role never serves or judges weights it did not check; here the check is the trainer's
signature on the manifest plus the raw hash of every shard, the same hashes a fetch verifies, and
the spec's pinned hash of the weights.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping

import torch

from node.fp8.quantize import quantize_weight
from node.model.checkpoint import state_dict_to_hf
from node.model.errors import ModelLoadError, WeightsHashMismatch
from node.model.quantization import SCALE_SUFFIX, scale_shape
from node.model.served_form import quantised_in
from node.model.spec import DTYPES, resolve
from node.model.streamed_weights import StreamedWeights
from node.model.weights_digest import DigestingReads, WeightsDigest
from node.roles.common import fresh_model, model_config
from protocol.errors import ProtocolError
from protocol.messages import RunSpec
from shardcast.codec import StateBytes, TensorBytes, matches_manifest
from shardcast.fetch import Fetcher
from shardcast.manifest import Manifest, TrustedPublishers
from shardcast.store import Store

log = logging.getLogger(__name__)


class ServedBytes:
    """A version's served form made from its values as they are read (a `shardcast.codec.TensorBytes`): each
    weight named in `quantised` is quantised whole by the engines' rule (node/fp8/quantize.py) when its bytes
    or its scales are first asked for, the pair kept while the last `KEEP` weights asked for are (a check reads
    in payload order; a delta's decode reads its parent shard by shard on several threads); every other
    tensor's bytes come from `reads`. Made from the values the trainer quantised (the checkpoint's, in the
    run's dtype), it is the trainer's served version 0 byte for byte: the blocks of a piece are the blocks of
    the stacked tensor it was cut from, and the rule gives the same bytes on any device. `on_value(name,
    tensor)` sees each quantised weight's values when they are read (a check reads each once: a digest of
    the values, the spec's pin, in the same pass)."""

    KEEP = 16

    def __init__(self, values: Mapping[str, torch.Tensor], reads, quantised: set[str],  # noqa: ANN001 (TensorBytes)
                 on_value=None):  # noqa: ANN001 (a callable)
        self.values, self.reads, self.quantised, self.on_value = values, reads, set(quantised), on_value
        self._recent: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()  # a delta's decode reads its parent's shards on several threads

    def names(self) -> set[str]:
        return self.reads.names() | {f"{n}{SCALE_SUFFIX}" for n in self.quantised}

    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        weight = name.removesuffix(SCALE_SUFFIX)
        if weight not in self.quantised:
            return self.reads.header(name)
        shape = self.reads.header(weight)[1]
        return ("float8_e4m3fn", shape) if name == weight else ("float32", scale_shape(shape))

    def read(self, name: str, lo: int, hi: int):  # noqa: ANN201 (uint8 numpy)
        weight = name.removesuffix(SCALE_SUFFIX)
        if weight not in self.quantised:
            return self.reads.read(name, lo, hi)
        q, s = self._pair(weight)
        return (q if name == weight else s).reshape(-1).view(torch.uint8).numpy()[lo:hi]

    def _pair(self, weight: str) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            got = self._recent.get(weight)
        if got is None:
            value = self.values[weight]
            if self.on_value is not None:
                self.on_value(weight, value)
            got = quantize_weight(value.cpu())
            with self._lock:
                self._recent[weight] = got
                while len(self._recent) > self.KEEP:
                    self._recent.pop(next(iter(self._recent)))
        return got


def _quantisable(source, quantised: set[str]) -> bool:  # noqa: ANN001 (a TensorBytes)
    """Whether every weight a manifest lists with scales is one of `source`'s that the rule quantises (a float
    tensor of rank >= 2): else the manifest is not this checkpoint's served form, whatever its signer says."""
    names = source.names()
    return all(n in names and len(source.header(n)[1]) >= 2 and source.header(n)[0] in ("float32", "bfloat16", "float16")
               for n in quantised)


def has_checkpoint(spec: RunSpec) -> bool:
    """Whether this member can build version 0 itself (the tiny model, or the spec's directory is here)."""
    try:
        resolve(spec.model.source)
    except ModelLoadError:
        return False
    return True


class LocalVersion0:
    """This member's version 0 checked against a manifest once per manifest (the checkpoint is read and
    hashed whole: seconds to a minute at 30B) and kept (what is kept is the pinned reader, not weights),
    for the role's load of version 0 and, as a `Fetcher`'s `local` hook, as the parent of version 1's
    delta: a member that joins at version 1 or later downloads no shard of version 0 either."""

    def __init__(self, spec: RunSpec):
        self.spec = spec
        self._lock = threading.Lock()
        self._checked: dict[str, Mapping[str, torch.Tensor] | None] = {}

    def checked(self, m: Manifest) -> Mapping[str, torch.Tensor] | None:
        """`checked_version0`, once per manifest (its errors are not kept: asked again, it reads again)."""
        with self._lock:
            key = m.manifest_hash()
            if key not in self._checked:
                self._checked[key] = checked_version0(self.spec, m)
            return self._checked[key]

    def __call__(self, m: Manifest) -> TensorBytes | None:
        """The fetcher's hook: version 0's tensors as payload bytes when they are exactly `m`'s, else None."""
        if m.version != 0 or not has_checkpoint(self.spec):
            return None
        try:
            weights = self.checked(m)
        except (ModelLoadError, OSError) as exc:  # not the run's checkpoint, or unreadable: fetch version 0 then
            log.warning("version 0: the local checkpoint cannot stand in for the published one (%s)", exc)
            return None
        if weights is None:
            return None
        reads = weights if isinstance(weights, StreamedWeights) else StateBytes(dict(weights))
        quantised = quantised_in(e.name for e in m.tensors)
        return ServedBytes(weights, reads, quantised) if quantised else reads


async def local_version0(spec: RunSpec, store: Store, expect_hash: str | None = None,
                         own: LocalVersion0 | None = None) -> Mapping[str, torch.Tensor] | None:
    """Version 0's HF-named tensors from this member's checkpoint (read one at a time when a loader
    asks: `StreamedWeights`; the tiny model's in memory), or None when it has none, the manifest cannot
    be had now, or the published version 0 is not its checkpoint (fetch it then). `own`: the role's
    `LocalVersion0`, so the checkpoint is checked once for this and for version 1's parent."""
    if not has_checkpoint(spec) or store.payload_path(spec.run_id, 0).exists():
        return None  # beside the trainer (one store per host) version 0 is in the store already: read it there
    t0 = time.perf_counter()
    try:
        trusted = TrustedPublishers([spec.trainer] if spec.trainer else [])
        async with Fetcher(store, list(spec.shardcast_sources), trusted) as f:
            m = await f.manifest(spec.run_id, 0)
    except ProtocolError as exc:
        log.info("version 0: no manifest yet (%s); fetching it through shardcast", exc)
        return None
    if expect_hash is not None and m.manifest_hash() != expect_hash:
        log.warning("version 0: manifest hash is not the announced one; fetching it through shardcast")
        return None
    try:
        weights = await asyncio.to_thread((own or LocalVersion0(spec)).checked, m)
    except ModelLoadError as exc:
        log.warning("version 0: the local checkpoint cannot serve (%s); fetching it through shardcast", exc)
        return None
    if weights is None:
        log.info("version 0: the published weights differ from the local checkpoint (a warm-up ran); fetching them")
        return None
    log.info("version 0 from the local checkpoint in %.1f s (manifest checked, %.1f MiB not downloaded)",
             time.perf_counter() - t0, m.wire_bytes / 2**20)
    return weights


def checked_version0(spec: RunSpec, m: Manifest) -> Mapping[str, torch.Tensor] | None:
    """The member's version 0 when it is exactly manifest `m`'s (None otherwise), its weights hashed
    against the spec's pin in the same pass (`WeightsHashMismatch`; ModelLoadError for a checkpoint
    that does not open or fit the architecture)."""
    directory = resolve(spec.model.source)
    quantised = quantised_in(e.name for e in m.tensors)  # an FP8 run's version 0 is in its served form
    if directory is None:  # the tiny model: built and checked against the pin by load_model
        state = state_dict_to_hf(fresh_model(spec, "cpu"))
        source = StateBytes(state)
        if quantised and not _quantisable(source, quantised):
            return None
        source = ServedBytes(state, source, quantised) if quantised else source
        return state if matches_manifest(m.tensors, m.shards, m.shard_size, source) else None
    weights = StreamedWeights.of_checkpoint(directory, model_config(spec), DTYPES[spec.model.dtype])
    if quantised and not _quantisable(weights, quantised):
        return None
    digest = WeightsDigest()
    source = DigestingReads(weights, digest)
    if quantised:  # each quantised weight's values read once: quantised for the check, hashed for the pin
        source = ServedBytes(weights, source, quantised, on_value=digest.add)
    if not matches_manifest(m.tensors, m.shards, m.shard_size, source):
        return None
    for name in weights.names() - digest.names():  # tensors of no bytes: the payload has none to read
        digest.add(name, weights[name])
    got = digest.hexdigest(expected=weights.names())
    if spec.model.weights_hash is not None and got != spec.model.weights_hash:
        raise WeightsHashMismatch(f"{spec.model.source}: initial weights hash to {got}, the run's spec pins "
                                  f"{spec.model.weights_hash}")
    return weights.pin(digest.tensor_hashes)
