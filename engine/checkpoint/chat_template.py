"""A checkpoint's own chat template (Jinja), rendered the way transformers' `apply_chat_template`
renders it: a sandboxed environment with trim_blocks / lstrip_blocks, `raise_exception`, `tojson`
and `strftime_now`, the tokenizer's bos/eos token strings, and `add_generation_prompt`.

The end-of-turn token is the special token the template writes after each message's content
(ChatML's <|im_end|>, Llama 3's <|eot_id|>): generation stops there, as a chat client expects.
Models without a template (random-weight presets) keep pdserve's simple one (router/openai_protocol).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

# Special tokens that end an assistant turn in the common template families.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>", "<|eom_id|>")


class ChatTemplateError(ValueError):
    """The template refused the conversation (e.g. roles that do not alternate) or failed."""


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    from jinja2 import TemplateError  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str | None = None
    eos_token: str | None = None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError  # noqa: PLC0415

        try:
            return _compile(self.source).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise ChatTemplateError(f"the model's chat template failed on these messages: {e}") from None

    def end_of_turn_tokens(self) -> list[str]:
        """Special tokens that end a turn and that this template uses (plus its eos token)."""
        found = [t for t in END_OF_TURN_TOKENS if t in self.source]
        if self.eos_token and self.eos_token not in found:
            found.append(self.eos_token)
        return found


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def chat_template_from_config(tok_cfg: dict[str, Any]) -> ChatTemplate | None:
    """From a tokenizer_config.json dictionary (None without a usable template). A list of named
    templates (newer checkpoints) yields the one named "default"."""
    src = tok_cfg.get("chat_template")
    if isinstance(src, list):
        src = next((t.get("template") for t in src if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(src, str) or not src.strip():
        return None
    return ChatTemplate(src, _token_str(tok_cfg.get("bos_token")), _token_str(tok_cfg.get("eos_token")))


__all__ = ["ChatTemplate", "ChatTemplateError", "chat_template_from_config", "END_OF_TURN_TOKENS"]
