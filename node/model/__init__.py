"""The one causal-LM definition (Qwen3-MoE layout; dense Qwen3 and Llama too) and its checkpoints."""

from node.model.checkpoint import InvalidCheckpoint, load_checkpoint, save_checkpoint
from node.model.config import InvalidModelConfig, ModelConfig
from node.model.qwen3_moe import CausalLM, ModelOutput
from node.model.tokenizer import CharTokenizer

__all__ = ["CausalLM", "ModelOutput", "ModelConfig", "InvalidModelConfig", "InvalidCheckpoint",
           "load_checkpoint", "save_checkpoint", "CharTokenizer"]
