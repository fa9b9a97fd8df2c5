"""HF config.json <-> ModelConfig, field by field: every field is used, checked, or refused by name.

Three kinds of field: *used* (mapped onto ModelConfig), *inert* (no effect on the forward pass:
bookkeeping such as `architectures`, token ids that belong to the tokenizer/generation config,
initialisation ranges, cache switches), and *fixed* (a known field whose value must be the one we
build, e.g. `attention_dropout` 0 or `use_sliding_window` false). Anything else raises
`UnsupportedModelField` naming it. Absent optional fields take the value `transformers`' own
config class gives them for that model_type (listed in `_HF_DEFAULTS`), so a config.json means
the same model here as there.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from node.model.config import InvalidModelConfig, ModelConfig, RopeScaling
from node.model.errors import MissingModelFile, UnsupportedModelField, UnsupportedModelType
from node.model.quantization import BlockFP8, block_fp8_of

_INERT = {
    "architectures", "transformers_version", "_name_or_path", "name_or_path", "_model_name_or_path", "dtype",
    "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "initializer_range",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id",
    "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "output_router_logits", "model_type",
    "tie_encoder_decoder", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "finetuning_task", "cross_attention_hidden_size", "add_cross_attention",
}
"""Fields that do not change the function the model computes."""
_FIXED = {"attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1, "use_sliding_window": False,
          "attention_bias": False, "hidden_act": "silu"}
"""Known fields whose value must be this (others are refused)."""
_SLIDING = {"sliding_window", "max_window_layers"}
"""Only meaningful with use_sliding_window true (which is refused)."""
_COMMON = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
           "rope_theta", "rope_scaling", "rope_parameters", "layer_types"}
_MOE = {"moe_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
        "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef"}
_USED = {"llama": _COMMON, "qwen3": _COMMON, "qwen3_moe": _COMMON | _MOE}
_HF_DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False},
    "qwen3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False, "head_dim": 128},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
                  "decoder_sparse_step": 1, "norm_topk_prob": False, "router_aux_loss_coef": 0.001,
                  "mlp_only_layers": [], "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128},
}
"""transformers' config-class defaults for optional fields (checked against transformers 5.24 in tests)."""
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_ARCH = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def config_from_hf(raw: dict, where: str = "config.json") -> ModelConfig:
    """Our ModelConfig for an HF config dict; `where` names the file in errors."""
    kind = raw.get("model_type")
    if kind not in _USED:
        raise UnsupportedModelType(f"{where}: model_type {kind!r} is not supported (qwen3, qwen3_moe, llama); "
                                   "convert the checkpoint to one of these or add the architecture to node/model")
    for name, value in raw.items():
        if name in _INERT or name in _USED[kind] or name in _SLIDING:
            continue
        if name in _FIXED:
            if value != _FIXED[name]:
                raise UnsupportedModelField(f"{where}: {name}={value!r} is not supported (only {_FIXED[name]!r})")
            continue
        if name == "quantization_config":
            block_fp8_of(value, where)  # block-scaled FP8 loads (node/model/quantization.py); others are refused
            continue
        raise UnsupportedModelField(f"{where}: field {name!r} is not implemented for model_type {kind}; "
                                    "remove it only if it does not change the model")
    missing = [f for f in _REQUIRED if f not in raw]
    if missing:
        raise InvalidModelConfig(f"{where}: required field(s) {missing} missing")
    layer_types = raw.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelField(f"{where}: layer_types {sorted(set(layer_types))}: only full_attention is built")
    cfg = {**_HF_DEFAULTS[kind], **{k: v for k, v in raw.items() if k in _USED[kind] - {"layer_types"}}}
    cfg["model_type"] = kind
    if "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    if cfg.get("head_dim") is None:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["rope_theta"], cfg["rope_scaling"] = _rope(cfg.pop("rope_theta", None), cfg.pop("rope_scaling", None),
                                                   cfg.pop("rope_parameters", None), kind, where)
    try:
        return ModelConfig.model_validate(cfg)
    except ValidationError as exc:
        raise InvalidModelConfig(f"{where}: {exc}") from exc


def _rope(theta, scaling: dict | None, params: dict | None, kind: str, where: str) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either the transformers<5 fields (rope_theta, rope_scaling) or v5's rope_parameters."""
    spec = dict(params or scaling or {})
    theta = float(spec.pop("rope_theta", None) or theta or 10000.0)
    rope_type = spec.pop("rope_type", spec.pop("type", "default"))
    if rope_type == "default":
        if spec:
            raise UnsupportedModelField(f"{where}: rope fields {sorted(spec)} with the default rope_type")
        return theta, None
    allowed = {"llama3", "linear"} if kind == "llama" else {"linear"}
    if rope_type not in allowed:
        raise UnsupportedModelField(f"{where}: rope_type {rope_type!r} is not implemented for {kind} "
                                    f"(supported: default, {', '.join(sorted(allowed))})")
    if spec.get("attention_factor") not in (None, 1.0):
        raise UnsupportedModelField(f"{where}: rope attention_factor {spec['attention_factor']} is not implemented")
    spec.pop("attention_factor", None)
    try:
        return theta, RopeScaling(rope_type=rope_type, **spec)
    except ValidationError as exc:
        raise UnsupportedModelField(f"{where}: rope scaling {spec}: {exc}") from exc


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """config.json for `cfg` as transformers and vLLM read it (only fields the model_type has)."""
    d = {"architectures": [_ARCH[cfg.model_type]], "model_type": cfg.model_type, "torch_dtype": dtype,
         "attention_dropout": 0.0, "attention_bias": False, "hidden_act": cfg.hidden_act}
    keys = _COMMON - {"rope_scaling", "rope_parameters", "rope_theta", "layer_types"}
    if cfg.model_type == "qwen3_moe":
        keys |= _MOE - {"num_local_experts"}
    d.update({k: getattr(cfg, k) for k in sorted(keys)})
    d["rope_theta"] = cfg.rope_theta
    d["rope_scaling"] = cfg.rope_scaling.model_dump() if cfg.rope_scaling else None
    if cfg.model_type == "llama":
        d.update(mlp_bias=False, pretraining_tp=1)
    else:
        d.update(use_sliding_window=False, sliding_window=None, output_router_logits=False)
    return d


def read_config(path: Path) -> ModelConfig:
    """ModelConfig from a config.json file (or a directory holding one)."""
    raw, where = _raw_config(path)
    return config_from_hf(raw, where)


def read_quantization(path: Path) -> BlockFP8 | None:
    """How a checkpoint's weights are stored: block-scaled FP8 (its `quantization_config`) or None (plain
    floating point); other schemes raise `UnsupportedQuantization`."""
    raw, where = _raw_config(path)
    qc = raw.get("quantization_config")
    return None if qc is None else block_fp8_of(qc, where)


def _raw_config(path: Path) -> tuple[dict, str]:
    path = path / "config.json" if path.is_dir() else path
    if not path.exists():
        raise MissingModelFile(f"{path} is missing: a model directory needs config.json (HF layout)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidModelConfig(f"cannot read model config {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise InvalidModelConfig(f"{path}: not a JSON object")
    return raw, str(path)
