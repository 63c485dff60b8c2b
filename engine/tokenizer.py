"""Tokenizers: bytes for random models, `tokenizer.json` for real checkpoints, and an
incremental detokenizer for streaming (never emits half a UTF-8 character)."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

from engine.config import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte; ids >= 256 are specials (bos, eos, unused) and decode to ''."""

    bos_id = BYTE_BOS_ID
    eos_id = BYTE_EOS_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: str | Path, bos_id: int | None, eos_id: int | None):
        from tokenizers import Tokenizer as _T  # noqa: PLC0415

        self._tok = _T.from_file(str(path))
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model: str, bos_id: int | None, eos_id: int | None) -> Tokenizer:
    """tokenizer.json of a checkpoint directory if present, else bytes."""
    f = Path(model) / "tokenizer.json"
    if Path(model).is_dir() and f.is_file():
        return HFTokenizer(f, bos_id, eos_id)
    return ByteTokenizer()


class Detokenizer:
    """Turns a growing list of ids into text deltas, decoding only a short window per token (the
    SSE loop calls this once per token; decoding the whole output each time is quadratic).

    `prefix` .. `read` is the window already emitted; text that ends in U+FFFD (an incomplete
    multi-byte character) is held back until later tokens complete it. Decoding from `prefix`
    rather than from `read` keeps tokenizers that render a token differently at the start of a
    string (leading spaces) consistent."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the decode window
        self.read = 0  # ids[:read] are already emitted as text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the end becomes U+FFFD)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        emitted = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        if text.endswith("\ufffd") and not final:
            return ""
        self.prefix, self.read = self.read, len(self.ids)  # tokens that render as '' advance it too
        return text[len(emitted):] if len(text) > len(emitted) else ""
