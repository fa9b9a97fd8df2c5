"""Inference engines. The built-in torch engine: KV cache, continuous batching, seeded sampling."""

from node.engine.engine import Completion, Engine, Request, RequestTooLong
from node.engine.sampling import SamplingParams

__all__ = ["Engine", "Request", "Completion", "SamplingParams", "RequestTooLong"]
