"""Typed errors for everything that can be wrong with a model before it runs.

Each names the file or field at fault and says what to do. Loading is all-or-nothing: these are
raised before a model object is handed out, never after part of it was filled.
"""

from __future__ import annotations


class ModelLoadError(ValueError):
    """Base class: a model (config, weights, tokenizer or spec) that cannot be loaded as asked."""


class MissingModelFile(ModelLoadError):
    """A file the model directory must hold is absent (config.json, weights, tokenizer, a shard)."""


class UnsupportedModelType(ModelLoadError):
    """config.json's `model_type` is not one this project builds (qwen3, qwen3_moe, llama)."""


class UnsupportedModelField(ModelLoadError):
    """config.json holds a field we do not implement, or a value of a known field we cannot honour."""


class TokenizerMismatch(ModelLoadError):
    """The tokenizer produces ids the model's embedding does not have."""


class WeightsHashMismatch(ModelLoadError):
    """The initial weights differ from the hash the run's model spec pins (version 0 must agree)."""


class ModelTooLarge(ModelLoadError):
    """The model (estimated before loading) does not fit in the memory this node has."""


class UnknownModelName(ModelLoadError):
    """A model name that is neither a directory nor in the registry."""


class InvalidCheckpoint(ModelLoadError):
    """A checkpoint that is missing, unreadable, or does not fit the model it claims."""


class UnsupportedQuantization(UnsupportedModelField):
    """config.json's `quantization_config` names a scheme we do not load (only block-scaled FP8 e4m3 in
    128 x 128 blocks, the Hugging Face / DeepSeek layout)."""


class MismatchedScales(InvalidCheckpoint):
    """An FP8 checkpoint whose `weight_scale_inv` tensors do not fit their weights (shape, dtype, or absent)."""
