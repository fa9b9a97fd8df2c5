"""vLLM as a primerl-node inference engine (`join --role inference --engine vllm`).

`make_engine(model_dir, ...)` starts and supervises a vLLM server and returns a `VLLMEngine`, the
built-in `Engine`'s surface over vLLM's token-in/token-out API. Nothing here is imported unless
asked for; vLLM itself runs in its own environment (PRIMERL_VLLM_PYTHON), never imported here.
"""

from __future__ import annotations


def make_engine(model_dir: str, **settings):
    """Start vLLM on `model_dir` with `VLLMSettings(**settings)` and return a started VLLMEngine."""
    from contrib.vllm.engine import VLLMEngine
    from contrib.vllm.settings import VLLMSettings

    return VLLMEngine.start(VLLMSettings(model=model_dir, **settings))


__all__ = ["make_engine"]
