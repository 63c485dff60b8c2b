"""Log probabilities in the OpenAI wire formats, as pure functions (tested without a server).

Completions (legacy): {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, parallel lists;
with `echo` the prompt's tokens come first and the first prompt token's logprob is null (as vLLM
returns it). Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}.

A token's text is its own bytes decoded on their own (a token that holds part of a multi-byte
character shows U+FFFD there; its `bytes` are exact, so clients can join them).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from engine.checkpoint.tokenizer import Tokenizer
from engine.sequence import TokenLogprob


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(tok: Tokenizer, token_id: int) -> bytes:
    own = getattr(tok, "token_bytes", None)
    if own is not None:  # the byte tokenizer knows its bytes
        return bytes(own(token_id))
    piece = getattr(tok, "id_to_token", lambda _i: None)(token_id)
    if piece is None:  # byte tokenizer, or an id outside the vocab
        return tok.decode([token_id]).encode()
    table = _byte_level_decoder()
    if all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return piece.encode()  # not a byte-level vocab entry (e.g. an added token with spaces)


def token_text(tok: Tokenizer, token_id: int) -> str:
    return token_bytes(tok, token_id).decode("utf-8", errors="replace")


def completion_logprobs(entries: list[TokenLogprob | None], tok: Tokenizer, offset: int = 0) -> dict[str, Any]:
    """Legacy completions `logprobs` object for these tokens; text offsets start at `offset`."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        if e is None:  # the first prompt token: nothing predicted it
            continue
        text = token_text(tok, e.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append({token_text(tok, i): lp for i, lp in e.top} if e.top else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def first_prompt_entry(prompt_ids: list[int], tok: Tokenizer) -> dict[str, Any]:
    """The echoed first prompt token: its text, a null logprob and null alternatives."""
    text = token_text(tok, prompt_ids[0])
    return {"tokens": [text], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}


def merge_completion(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: a[k] + b[k] for k in a}


def chat_logprobs(entries: list[TokenLogprob | None], tok: Tokenizer) -> dict[str, Any]:
    content = []
    for e in entries:
        if e is None:
            continue
        b = token_bytes(tok, e.token_id)
        content.append(
            {
                "token": b.decode("utf-8", errors="replace"),
                "logprob": e.logprob,
                "bytes": list(b),
                "top_logprobs": [
                    {"token": token_text(tok, i), "logprob": lp, "bytes": list(token_bytes(tok, i))} for i, lp in e.top
                ],
            }
        )
    return {"content": content}


__all__ = [
    "chat_logprobs",
    "completion_logprobs",
    "first_prompt_entry",
    "merge_completion",
    "token_bytes",
    "token_text",
]
