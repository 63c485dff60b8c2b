"""Reading an OpenAI request's body, and the error every refusal raises: `parse_json` turns raw
bytes into JSON or a 400 (not JSON, nested too deeply, a lone surrogate); `OpenAIError` carries
the OpenAI-style body {"error": {message, type, param, code}}. router/openai/protocol.py checks
the fields; it re-exports these names.
"""

from __future__ import annotations

import json
from typing import Any


class OpenAIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):  # noqa: A002 - the wire name
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,  # noqa: A002
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


MAX_JSON_DEPTH = 32  # far beyond any OpenAI request (chat content parts sit at depth 4)


def parse_json(raw: bytes) -> Any:
    """The request body, or a 400: not JSON, nested deeper than MAX_JSON_DEPTH (json.loads itself
    raises RecursionError near Python's recursion limit), or holding a string that is not valid
    Unicode (a lone surrogate such as "\\ud800", which no tokenizer can encode)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad(
            f"The JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels).", code="invalid_json"
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"We could not parse the JSON body of your request: {e}", code="invalid_json") from None
    _check_json_value(body)
    return body


def _check_json_value(body: Any) -> None:
    """Depth and Unicode checks over the parsed body, iteratively (no recursion to exhaust)."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad(f"The JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels).", code="invalid_json")
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, path)
                stack.append((v, f"{path}.{k}" if path else k, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{path}.{i}" if path else str(i), depth + 1) for i, v in enumerate(value))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(
            f"Invalid Unicode in '{path or 'body'}': {text[e.start : e.end].encode('unicode_escape').decode()} at "
            f"character {e.start} is a lone surrogate, which is not a character.",
            param=path or None,
            code="invalid_unicode",
        ) from None
