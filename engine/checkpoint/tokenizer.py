"""Tokenizers: bytes for random models, `tokenizer.json` for real checkpoints, and an
incremental detokenizer for streaming (never emits half a UTF-8 character)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from engine.checkpoint.chat_template import ChatTemplate, chat_template_from_config
from engine.config import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB


class Tokenizer(Protocol):
    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The checkpoint's own; None = pdserve's simple template."""

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """Chat completions stop at these."""

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte; ids >= 256 are specials (bos, eos, unused) and decode to ''."""

    bos_id = BYTE_BOS_ID
    eos_id = BYTE_EOS_ID
    chat_template = None
    end_of_turn_ids: tuple[int, ...] = ()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < BYTE_VOCAB else b""


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer. `add_bos`: prepend bos to every encoded text, as the
    checkpoint's tokenizer_config.json says (SmolLM2 does not; Llama 3 does)."""

    def __init__(
        self,
        path: str | Path | None,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool = True,
        json_str: str | None = None,
    ):
        from tokenizers import Tokenizer as _T  # noqa: PLC0415

        self._tok = _T.from_str(json_str) if json_str is not None else _T.from_file(str(path))
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.chat_template: ChatTemplate | None = None
        self.end_of_turn_ids: tuple[int, ...] = ()

    def set_chat_template(self, template: ChatTemplate | None) -> None:
        self.chat_template = template
        ids = [self.token_id(t) for t in template.end_of_turn_tokens()] if template else []
        self.end_of_turn_ids = tuple(sorted({i for i in ids if i is not None}))

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Special-token text (e.g. a chat template's <|im_start|>) becomes its special id.
        add_bos=False for text that already carries its bos (a rendered chat template)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_id(self, text: str) -> int | None:
        """The id of one token given as text (e.g. "<|im_end|>"), or None."""
        return self._tok.token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


def read_tokenizer_config(model: str) -> dict:
    """tokenizer_config.json of a checkpoint directory ({} if absent); for a .gguf file, the same
    fields from its metadata."""
    p = Path(model)
    if p.is_file() and p.suffix.lower() == ".gguf":
        from engine.gguf_file import GGUFFile  # noqa: PLC0415

        return GGUFFile(p).tokenizer_config()
    f = p / "tokenizer_config.json"
    if p.is_dir() and f.is_file():
        import json  # noqa: PLC0415

        return json.loads(f.read_text())
    return {}


def load_tokenizer(model: str, bos_id: int | None, eos_id: int | None) -> Tokenizer:
    """tokenizer.json of a checkpoint directory, the tokenizer inside a .gguf file, else bytes."""
    p = Path(model)
    if p.is_file() and p.suffix.lower() == ".gguf":
        from engine.gguf_file import GGUFFile  # noqa: PLC0415

        g = GGUFFile(p)
        tok = HFTokenizer(None, bos_id, eos_id, add_bos=g.add_bos, json_str=g.tokenizer_json())
        tok.set_chat_template(chat_template_from_config(g.tokenizer_config()))
        return tok
    f = p / "tokenizer.json"
    if p.is_dir() and f.is_file():
        tok_cfg = read_tokenizer_config(model)
        tok = HFTokenizer(f, bos_id, eos_id, add_bos=bool(tok_cfg.get("add_bos_token", True)))
        tok.set_chat_template(chat_template_from_config(tok_cfg))
        return tok
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
        emitted = self.tok.decode(self.ids[self.prefix : self.read])
        text = self.tok.decode(self.ids[self.prefix :])
        if text.endswith("\ufffd") and not final:
            return ""
        self.prefix, self.read = self.read, len(self.ids)  # tokens that render as '' advance it too
        return text[len(emitted) :] if len(text) > len(emitted) else ""
