"""vLLM as an inference node's engine (registered as "vllm" in node/engine/registry.py).

The server starts without weights (config.json only, `load_format=dummy`) while the node joins and
fetches; start-up takes tens of seconds, and WORKDIR/engine.ready marks its end. Every policy version
the node fetches is loaded in place from the shardcast store's payload files, which vLLM's workers map
themselves (no copy: a 30B version is 61 GB in bf16); version 0 from the member's own checkpoint is read
from its files as they are. Anything else (an FP8 checkpoint served dequantised, a payload dropped since
its fetch) is written as an HF checkpoint (beside, then renamed: a crash never leaves a half written one
under its name) and loaded from it; the last `CHECKPOINTS_KEPT` of those stay on disk.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from pydantic import ValidationError

from contrib.vllm import make_engine, vllm_python
from contrib.vllm.server import VLLMUnavailable
from contrib.vllm.settings import VLLMSettings
from node.engine import Request, SamplingParams
from node.engine.registry import EngineSetup, EngineUnavailable
from node.model.checkpoint import CONFIG, copy_companions, save_tensors
from node.model.streamed_weights import StreamedWeights, headers
from shardcast.locks import held

log = logging.getLogger(__name__)

SHARD_BYTES = 2 << 30
"""Largest safetensors file a written version is split into (what one shard costs on the host)."""
CHECKPOINTS_KEPT = 2
"""Checkpoint directories written for vLLM that stay on disk (the loaded version and the one before)."""
NODE_OWNED = ("model", "load_format")
"""VLLMSettings the node sets itself (the checkpoint it serves and how it is loaded)."""
SPEC_OWNED = {"dtype": "model.dtype", "quantization": "model.fp8"}
"""VLLMSettings the run's signed spec sets (the field that does): validators recompute in the spec's dtype and
precision and judge by its thresholds, so a node serving another would be judged against numbers it does not
compute (a bf16 run's validator judged `quantization=fp8` rollouts by bf16 bounds)."""


def write_hf_checkpoint(state: Mapping[str, torch.Tensor], hf_config: dict, directory: Path,
                        companions_from: Path | None = None) -> Path:
    """`state` (HF names) as an HF directory, with `companions_from`'s tokenizer files and generation
    config (the model directory the run started from), so each version opens as a whole checkpoint; a
    version over `SHARD_BYTES` is written in shards, each shard's tensors looked up while it is written
    (a version 0 read from the member's checkpoint is then on the host one shard at a time)."""
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / CONFIG).write_text(json.dumps(hf_config, indent=2))
    total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in headers(state).values())
    save_tensors(state, tmp, {"format": "pt"}, SHARD_BYTES if total > SHARD_BYTES else None)
    if companions_from is not None:
        copy_companions(companions_from, tmp)
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)
    return directory


class VLLMNodeEngine:
    """The built-in engine's surface over a supervised vLLM server."""

    @staticmethod
    def check(setup: EngineSetup) -> dict[str, object]:
        """The vLLM settings the node starts with, once the interpreter and `setup.options` are checked."""
        try:
            vllm_python()
        except VLLMUnavailable as exc:
            raise EngineUnavailable(str(exc)) from exc
        settings: dict[str, object] = {"dtype": setup.dtype, "max_num_seqs": setup.max_batch,
                                       "max_model_len": setup.max_seq_len}
        for option in setup.options:
            name, sep, value = option.partition("=")
            if name in SPEC_OWNED:
                raise EngineUnavailable(f"--vllm {option!r}: the run's spec sets {name} ({SPEC_OWNED[name]}: "
                                        f"dtype {setup.dtype}, fp8 {setup.fp8}); validators recompute that way")
            if not sep or name in NODE_OWNED or name not in VLLMSettings.model_fields:
                raise EngineUnavailable(f"--vllm {option!r}: expected KEY=VALUE with KEY a VLLMSettings field "
                                        f"other than {', '.join(NODE_OWNED)}")
            settings[name] = value
        try:
            checked = VLLMSettings(model="-", load_format="dummy", **settings)
        except ValidationError as exc:
            raise EngineUnavailable(f"--vllm: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}") from exc
        if not checked.enforce_eager:
            # the worker extension captures each token's hidden state with forward hooks, which vLLM's compiled
            # and graph-captured forwards skip: the node would submit rollouts without proofs and be banned
            raise EngineUnavailable("--vllm enforce_eager=false: vLLM's compiled forwards skip the hooks that capture "
                                    "the hidden states every rollout's proof is made of; the node serves eager only")
        return {name: getattr(checked, name) for name in settings}

    @classmethod
    def from_setup(cls, setup: EngineSetup) -> VLLMNodeEngine:
        """The registry's factory (`vllm`): the server started and warm (blocking: tens of seconds)."""
        return cls(setup)

    def __init__(self, setup: EngineSetup):
        self.setup = setup
        self.root = setup.workdir / "vllm"
        base = self.root / "base"
        base.mkdir(parents=True, exist_ok=True)
        (base / CONFIG).write_text(json.dumps(setup.hf_config, indent=2))
        if setup.model_dir is not None:
            copy_companions(setup.model_dir, base)
        (setup.workdir / "engine.ready").unlink(missing_ok=True)
        self.engine = make_engine(
            str(base), load_format="dummy", log_path=str(setup.workdir / "vllm.log"), cancel=setup.cancel,
            engine={"eos_id": setup.eos_id, "encode": setup.encode, "salt": setup.salt,
                    "max_concurrency": setup.max_batch}, **self.check(setup))
        # One short request first: vLLM's first batch is several times slower than the next (measured
        # 2.4 s vs 0.35 s for 32 requests), and a node should take leases only once it is warm.
        self.engine.generate([Request("warm-up", [setup.bos_id] * 8, SamplingParams(temperature=1.0, max_new_tokens=8))])
        (setup.workdir / "engine.ready").write_text(self.engine.server.url + "\n")

    @property
    def server(self):
        return self.engine.server

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load `version` in place (sequences in flight are kept, or rerun by the adapter where vLLM recomputed
        their KV under the new weights). A version held in this host's shardcast store (what a fetch returns:
        `shardcast.fetch.PayloadTensors`) is read by vLLM's workers from the store's payload files, under the
        version's lock: no copy. Version 0 read from the member's own checkpoint (`StreamedWeights`) is read
        by vLLM from those files as they are, unless they hold FP8 weights (which vLLM would take for its own
        scheme); anything else is written as an HF checkpoint first, shard by shard."""
        files = getattr(state_dict, "files", None)
        if files is not None:
            with held(files.lock, exclusive=False):  # retention leaves the files while vLLM reads them
                if files.path.exists():  # (retention may have dropped this payload since the fetch: then a copy)
                    self.engine.load_payload(files, version)
                    return
            log.info("v%d: its payload left the store since the fetch; written out for vLLM instead", version)
        if isinstance(state_dict, StreamedWeights) and state_dict.shards.quantization is None:
            return self._load_checkpoint_as_it_is(state_dict, version)
        self.engine.load_weights(write_hf_checkpoint(state_dict, self.setup.hf_config, self.root / f"v{version}",
                                                     self.setup.model_dir), version)
        written = sorted((int(d.name[1:]) for d in self.root.glob("v*") if d.name[1:].isdigit()), reverse=True)
        for old in written[CHECKPOINTS_KEPT:]:
            shutil.rmtree(self.root / f"v{old}", ignore_errors=True)

    def _load_checkpoint_as_it_is(self, weights: StreamedWeights, version: int) -> None:
        """Version 0 from the member's own checkpoint, read by vLLM's workers from its files (no copy: a 30B
        checkpoint is 61 GB in bf16, and a host with one disk of 64 GB could not hold it twice). vLLM casts
        to the spec's dtype as the node's own read does. The check that pinned these files (their bytes
        hashed against the run's manifest) is kept by reading them again once vLLM has: a file changed in
        between is `InvalidCheckpoint`, as the node's own loader would raise it."""
        self.engine.load_weights(weights.shards.directory, version)
        for name in weights:
            weights[name]  # noqa: B018 (a pinned lookup re-hashes the bytes it reads)
        log.info("v%d loaded by vLLM from the checkpoint %s as it is (no copy written)", version,
                 weights.shards.directory)

    def add_request(self, request: Request) -> None:
        self.engine.add_request(request)

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self):
        return self.engine.step()

    def generate(self, requests: list[Request]):
        return self.engine.generate(requests)

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    def close(self) -> None:
        self.engine.close()
