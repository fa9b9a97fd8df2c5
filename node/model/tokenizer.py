"""Character-level tokenizer for the built-in tasks: one id per character, three specials."""

from __future__ import annotations

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
_CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ +-*/=()<>[]:;,.?!_'\"\n#"


class UnknownCharacter(ValueError):
    """Text holds a character outside the tokenizer's alphabet."""


class CharTokenizer:
    def __init__(self) -> None:
        self.itos = [PAD, BOS, EOS] + list(_CHARS)
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

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
        return "".join(self.itos[i] for i in ids if i >= 3)
