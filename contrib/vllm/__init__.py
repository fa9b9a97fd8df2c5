"""vLLM as a primerl-node inference engine (`join --role inference --engine vllm`).

`make_engine(model_dir, ...)` starts and supervises a vLLM server and returns a `VLLMEngine`, the
built-in `Engine`'s surface over vLLM's token-in/token-out API. Nothing here is imported unless
asked for; vLLM itself runs in its own environment (PRIMERL_VLLM_PYTHON), never imported here.
"""

from __future__ import annotations


def make_engine(model_dir: str, *, version: int = 0, log_path: str | None = None, engine: dict | None = None,
                cancel=None, **settings):
    """Start vLLM on `model_dir` (the weights of policy `version`) with `VLLMSettings(**settings)` and
    return a started VLLMEngine; `engine`: VLLMEngine options (eos_id, encode, salt, ...); `cancel`: a
    threading.Event that aborts the start-up. Raises `VLLMUnavailable` at once when there is no usable
    vLLM interpreter, `VLLMServerError` when the server does not come up."""
    from contrib.vllm.engine import VLLMEngine
    from contrib.vllm.server import vllm_python
    from contrib.vllm.settings import VLLMSettings

    vllm_python()
    return VLLMEngine.start(VLLMSettings(model=model_dir, **settings), log_path=log_path, cancel=cancel,
                            version=version, **(engine or {}))


def vllm_python(python: str | None = None) -> str:
    """The checked vLLM interpreter ($PRIMERL_VLLM_PYTHON); raises `VLLMUnavailable`."""
    from contrib.vllm.server import vllm_python as check

    return check(python)


__all__ = ["make_engine", "vllm_python"]
