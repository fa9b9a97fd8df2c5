"""Tokenizers behind one interface: the character tokenizer of the tiny model, and a checkpoint's own
Hugging Face tokenizer (with its chat template and the EOS/stop ids from its configs).

What every tokenizer offers (`Tokenizer`): `encode`/`decode` of plain text, `encode_prompt` of a
prompt given as text or as chat messages, `eos_id`, `pad_id`, `stop_ids` and `vocab_size`. Tasks
build prompts as text or messages and score decoded text, so no task knows token ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

from node.model.errors import MissingModelFile, ModelLoadError

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
_CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ +-*/=()<>[]:;,.?!_'\"\n#"

Prompt = str | list[dict[str, str]]
"""A prompt: plain text, or chat messages [{"role": ..., "content": ...}]."""


class UnknownCharacter(ValueError):
    """Text holds a character outside the tokenizer's alphabet."""


@runtime_checkable
class Tokenizer(Protocol):
    eos_id: int
    pad_id: int
    stop_ids: tuple[int, ...]
    """Ids that end a completion (EOS first)."""

    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str, bos: bool = False) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def encode_prompt(self, prompt: Prompt) -> list[int]: ...


class CharTokenizer:
    """One id per character, three specials; chat messages are rendered as their contents, one per line."""

    def __init__(self) -> None:
        self.itos = [PAD, BOS, EOS] + list(_CHARS)
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.stop_ids = (self.eos_id,)

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str, bos: bool = False) -> list[int]:
        try:
            ids = [self.stoi[c] for c in text]
        except KeyError as exc:
            raise UnknownCharacter(f"character {exc.args[0]!r} is not in the tokenizer's alphabet") from exc
        return [self.bos_id] + ids if bos else ids

    def decode(self, ids: list[int]) -> str:
        # ids past the alphabet (a model of a real vocabulary's width over this tokenizer: the benchmarks'
        # random shapes) decode to nothing, as the specials do
        n = len(self.itos)
        return "".join(self.itos[i] for i in ids if 3 <= i < n)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        return self.encode(text, bos=True)


class HFTokenizer:
    """A checkpoint directory's tokenizer (tokenizer.json / tokenizer_config.json, loaded offline)."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        if not (directory / "tokenizer.json").exists() and not (directory / "tokenizer.model").exists():
            raise MissingModelFile(f"{directory}: no tokenizer.json (or tokenizer.model); copy the checkpoint's "
                                   "tokenizer files next to config.json")
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ModelLoadError(f"Hugging Face tokenizers need transformers: pip install transformers ({exc})") from exc
        try:
            self.hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{directory}: tokenizer files unreadable: {exc}") from exc
        self.directory = directory
        eos = _generation_eos(directory)
        if not eos and self.hf.eos_token_id is not None:
            eos = [self.hf.eos_token_id]
        if not eos:
            raise ModelLoadError(f"{directory}: no EOS token in generation_config.json or tokenizer_config.json")
        self.eos_id, self.stop_ids = eos[0], tuple(eos)
        self.pad_id = self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eos_id
        self.bos_id = self.hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False)
        return ([self.bos_id] + ids) if bos and self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.hf.encode(prompt, add_special_tokens=True)
        if not self.has_chat_template:
            raise ModelLoadError(f"{self.directory}: the tokenizer has no chat template, and this task sends chat "
                                 "messages; use a checkpoint with chat_template in tokenizer_config.json")
        text = self.hf.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return self.hf.encode(text, add_special_tokens=False)


def _generation_eos(directory: Path) -> list[int]:
    path = directory / "generation_config.json"
    if not path.exists():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: unreadable ({exc})") from exc
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
