"""A chat request's messages as prompt ids: the message type, its text content parts, and the chat
template (the checkpoint's own Jinja template, else pdserve's simple one). router/openai/protocol.py
validates the rest of a chat request; it re-exports these names.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from engine.checkpoint.chat_template import ChatTemplateError
from engine.checkpoint.tokenizer import Tokenizer
from router.openai.body import bad


class ChatMessage(BaseModel):
    # strict, as every request model (router/openai/protocol.py): wrong types are 400s
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # str | list of {"type": "text", "text": str} | None


def message_text(msg: ChatMessage, i: int) -> str:
    c = msg.content
    if c is None or isinstance(c, str):
        return c or ""
    if isinstance(c, list):
        parts = []
        for j, part in enumerate(c):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(
                    "Only text content parts ({'type': 'text', 'text': ...}) are supported.",
                    param=f"messages.{i}.content.{j}",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad("'content' must be a string or a list of text parts.", param=f"messages.{i}.content")


def render_chat(messages: list[ChatMessage]) -> str:
    """pdserve's simple chat template, for models without one of their own (random-weight
    presets): a line per message, then the assistant's cue."""
    lines = [f"{m.role}: {message_text(m, i)}\n" for i, m in enumerate(messages)]
    return "".join(lines) + "assistant: "


def chat_prompt_ids(messages: list[ChatMessage], tok: Tokenizer) -> list[int]:
    """The conversation as prompt ids: the checkpoint's own Jinja template when it has one
    (with the assistant's generation prompt, as transformers' apply_chat_template renders it),
    else the simple template."""
    template = getattr(tok, "chat_template", None)
    if template is None:
        return tok.encode(render_chat(messages))
    msgs = [{"role": m.role, "content": message_text(m, i)} for i, m in enumerate(messages)]
    try:
        text = template.render(msgs, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise bad(f"The model's chat template rejected these messages: {e}", param="messages") from None
    return tok.encode(text, add_bos=False)  # the template writes its own bos, if it wants one
