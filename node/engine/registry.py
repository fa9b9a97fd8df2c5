"""Inference engines by name: a lookup table of import paths, each imported only when a node asks for it.

`join --role inference --engine NAME` builds `ENGINES[NAME]`; the inference role sees only the
`InferenceEngine` surface below, never an engine's module. Adding an engine is one entry:

    "builtin-cuda": EngineEntry("node.engine.cuda_engine:CudaEngine", claims="builtin", help="..."),

Every entry names an engine class; `build` calls its `from_setup(EngineSetup)`, the one construction
path, which for a `server` entry may start processes (vLLM, the expert-parallel world). A server class
may carry a `check(EngineSetup) -> dict` that refuses bad settings before anything starts.

Invariant: `node`, `protocol`, `shardcast` and `verification` import nothing from `contrib`; the
import paths here are strings, resolved by `importlib` only for the engine a node runs
(tests/test_import_rules.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from node.plugins import resolve
from protocol.model_spec import FP8_MODES

if TYPE_CHECKING:  # the registry stays light: `join --help` lists engines without importing torch
    import torch

    from node.engine.core import Completion, Request


class EngineUnavailable(RuntimeError):
    """The engine asked for cannot serve this run: unknown, not accepted by the run, or not installed here."""


class InferenceEngine(Protocol):
    """What the roles drive: the built-in engines (`node.engine.core.RequestQueue`), the expert-parallel
    world's rank 0 and vLLM all have it (tests/engine/test_engine_registry.py)."""

    max_seq_len: int
    """Longest prompt + completion the engine serves (the rollout driver bounds each turn by it)."""

    def add_request(self, request: Request) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> list[Completion]: ...
    def generate(self, requests: list[Request]) -> list[Completion]: ...
    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Queue policy `version` (HF names); it takes effect between two decode steps."""
    def close(self) -> None:
        """Stop what the engine started (a server, the ranks of its world); idempotent."""


@dataclass
class EngineSetup:
    """What a node knows when it builds its engine (before any policy version is loaded)."""

    model: Callable[[], Any]
    """A fresh model of the run's shape (in-process engines load policies into it)."""
    hf_config: dict
    """The model's Hugging Face config.json (engines that load checkpoints from disk)."""
    max_batch: int
    """Sequences decoded at once."""
    max_seq_len: int
    """Longest prompt + completion."""
    eos_id: int
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    bos_id: int
    capture_experts: bool
    """Record each position's routed experts (router replay)."""
    workdir: Path
    """The node's state directory (engines write logs and checkpoints under it)."""
    salt: str
    """Per-run salt (the run id): prefix-cache keys of one run never match another's."""
    options: list[str] = field(default_factory=list)
    """`KEY=VALUE` settings from the command line (`join --vllm`), engine-specific."""
    cancel: threading.Event = field(default_factory=threading.Event)
    """Set to abort a slow start-up (the node is stopping)."""
    device: str = "cpu"
    """Where an in-process engine serves (`join --device cpu|cuda[:i]`)."""
    fp8: str = "off"
    """FP8 weights: off | experts (routed experts only) | all (`join --fp8`, or the run spec's `model.fp8`)."""
    dtype: str = "float32"
    """The weights' dtype, the run spec's `model.dtype` (engines of their own processes serve in it; an
    in-process engine's `model` is made in it)."""
    ep: int = 1
    """Expert-parallel processes of one host serving together (`join --ep`; engines with `expert_parallel`)."""
    model_dir: Path | None = None
    """The HF directory the run's model came from (None: tiny-moe); engines that write checkpoints copy
    its tokenizer files and generation config beside each one."""
    gpu_memory_share: float = 0.9
    """Share of the GPU memory free when the engine starts (after its weights) that its KV cache may take
    (`join --gpu-memory-share`; lower it where other roles share the GPU); sizes the slots."""
    min_batch: int = 1
    """Fewest sequences the engine must hold at once (one lease group): a plan below it refuses to start."""

    def engine_kwargs(self) -> dict[str, Any]:
        """The built-in engines' constructor arguments (`core.EngineCore`'s and what each records), before
        any policy version is loaded (version -1)."""
        return dict(max_batch=self.max_batch, max_seq_len=self.max_seq_len, eos_id=self.eos_id, decode=self.decode,
                    capture_hidden=True, capture_experts=self.capture_experts, version=-1)


@dataclass(frozen=True)
class EngineEntry:
    path: str
    """"module:Class" of the engine; `Class.from_setup(EngineSetup)` builds it."""
    claims: str
    """The engine name its submissions carry (`RolloutSubmission.engine`; the run spec must accept it)."""
    help: str
    """One line for `join --help`."""
    server: bool = False
    """True: the engine starts processes of its own (and may `check` its settings); False: it serves in this one."""
    placed: bool = False
    """An in-process engine that takes `device=` and `fp8=` (and captures its graphs before serving)."""
    expert_parallel: bool = False
    """Serves with `EngineSetup.ep` > 1 processes (the others started by `join`, or by torchrun)."""
    fp8: bool = False
    """Serves block-scaled FP8 weights through `node.engine.fp8.model.apply_fp8_mode` (the validator's rule)."""


ENGINES: dict[str, EngineEntry] = {
    "builtin": EngineEntry("node.engine.engine:Engine", "builtin", "the built-in torch engine (CPU; FP8 with --fp8 "
                           "through the plain-torch reference GEMM: slow, for tests and small models)", fp8=True),
    "builtin-cuda": EngineEntry("node.engine.cuda_engine:CudaEngine", "builtin",
                                "the built-in engine on a CUDA device (--device cuda[:i]): CUDA graphs per batch bucket, "
                                "GPU sampling with the validator's seeded rule, FP8 with --fp8", placed=True, fp8=True),
    "builtin-ep": EngineEntry("node.engine.ep_world:EPLeader", "builtin",
                              "the built-in engine with expert parallelism over --ep N processes of this host (one "
                              "GPU each with --device cuda, NCCL; gloo on the CPU): experts split, attention "
                              "data-parallel, all-to-all dispatch", server=True, expert_parallel=True),
    "vllm": EngineEntry("contrib.vllm.node_engine:VLLMNodeEngine", "vllm",
                        "a supervised vLLM server (contrib/vllm; its interpreter is $PRIMERL_VLLM_PYTHON)", server=True),
}


class FP8Mismatch(EngineUnavailable):
    """`join --fp8` differs from the run spec's `model.fp8`: the validator recomputes in the spec's precision,
    so the node's honest rollouts would be judged against numbers it does not compute."""


def serving_fp8(run_fp8: str, flag: str | None) -> str:
    """The FP8 mode a node serves: the run spec's (`ModelSpec.fp8`) when `--fp8` is absent; a flag that
    names another is refused (`FP8Mismatch`) before anything starts."""
    if flag is None or flag == run_fp8:
        return run_fp8
    raise FP8Mismatch(f"--fp8 {flag} but this run serves fp8 {run_fp8} (its spec's model.fp8; validators recompute "
                      f"that way): drop --fp8 to follow the spec")


def entry(name: str) -> EngineEntry:
    try:
        return ENGINES[name]
    except KeyError:
        raise EngineUnavailable(f"unknown engine {name!r}; known: {', '.join(ENGINES)}") from None


def check(name: str, setup: EngineSetup) -> dict:
    """Refuse bad settings before anything starts; returns the settings the engine will start with."""
    e = entry(name)
    if setup.ep > 1 and not e.expert_parallel:
        raise EngineUnavailable(f"engine {name} cannot serve expert-parallel (--ep {setup.ep}); use --engine builtin-ep"
                                + ("; vLLM splits experts with --vllm data_parallel=N --vllm expert_parallel=true" if name == "vllm" else ""))
    if setup.fp8 not in FP8_MODES:
        raise EngineUnavailable(f"--fp8 must be one of {', '.join(FP8_MODES)}, not {setup.fp8!r}")
    if setup.fp8 != "off" and not e.fp8:
        # the validator recomputes with the block-scaled layout of apply_fp8_mode: another FP8 scheme
        # (vLLM's quantization=fp8) would be judged against numbers it does not compute
        raise EngineUnavailable(f"engine {name} cannot serve the block-scaled FP8 the run prescribes (fp8 "
                                f"{setup.fp8}); use --engine builtin-cuda (GPU) or builtin (CPU)")
    if not e.server:
        if setup.options:
            raise EngineUnavailable(f"engine {name} takes no options ({', '.join(setup.options)})")
        if not e.placed and setup.device != "cpu":
            raise EngineUnavailable(f"engine {name} serves on the CPU; for --device {setup.device} "
                                    f"use --engine builtin-cuda")
        if e.placed:
            return {"device": setup.device, "fp8": setup.fp8}
        return {"fp8": setup.fp8} if setup.fp8 != "off" else {}
    checker = getattr(resolve(e.path), "check", None)  # a server's own refusals
    return checker(setup) if checker else {}


def build(name: str, setup: EngineSetup) -> InferenceEngine:
    """The engine `name`, started, with no policy loaded yet (version -1; blocking: run it in a thread)."""
    return resolve(entry(name).path).from_setup(setup)


def close(engine: InferenceEngine) -> None:
    """Stop what the engine started (`InferenceEngine.close`)."""
    engine.close()
