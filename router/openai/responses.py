"""The OpenAI wire protocol, response side, as pure functions: stop-string filtering of the
detokenized stream, full responses, SSE chunks and the usage chunk. The request side (validation,
`Prepared`) is router/openai/protocol.py."""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from router.openai.protocol import Prepared

SSE_DONE = "data: [DONE]\n\n"


# ------------------------------------------------------------------------------ stop strings
class StopFilter:
    """Turns detokenized deltas into text safe to emit: text that could still become a stop string
    is held back, and nothing at or after a stop string is ever emitted."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.text = ""  # everything detokenized so far (truncated at the stop string once found)
        self.sent = 0  # chars of self.text already emitted
        self.stopped = False

    def push(self, delta: str) -> str:
        if self.stopped:
            return ""
        self.text += delta
        # A stop string cannot start before `sent`: its beginning would have been held back.
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            self.stopped, self.text = True, self.text[:end]
            return self._emit(end)
        return self._emit(len(self.text) - self._held())

    def finish(self) -> str:
        """The held-back tail, once generation ended without reaching a stop string."""
        return self._emit(len(self.text))

    def _held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        tail = self.text[self.sent :]
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:k]):
                    best = k
                    break
        return best

    def _emit(self, upto: int) -> str:
        out, self.sent = self.text[self.sent : upto], max(self.sent, upto)
        return out


# ------------------------------------------------------------------------------ responses
def new_request_id(kind: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def json_safe(x: Any) -> Any:
    """NaN/inf become null (strict JSON has no such numbers; a 0-second transfer has inf GB/s)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` (the prompt tokens served from
    the prefix cache, not computed) where the server knows it, as OpenAI and vLLM report it."""
    use: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        use["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return use


def _head(p: Prepared, rid: str, created: int, chunk: bool) -> dict[str, Any]:
    obj = "text_completion" if p.kind == "completion" else "chat.completion.chunk" if chunk else "chat.completion"
    return {"id": rid, "object": obj, "created": created, "model": p.model}


def full_response(
    p: Prepared,
    rid: str,
    created: int,
    text: str,
    finish_reason: str,
    use: dict[str, int],
    timeline: dict | None,
    logprobs: dict | None = None,
) -> dict[str, Any]:
    if p.kind == "completion":
        choice: dict[str, Any] = {
            "index": 0,
            "text": p.prompt_text + text if p.echo else text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    else:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    return {
        **_head(p, rid, created, False),
        "choices": [choice],
        "usage": use,
        "pdserve": {"timeline": json_safe(timeline)},
    }


def stream_chunk(
    p: Prepared,
    rid: str,
    created: int,
    text: str,
    finish_reason: str | None,
    first: bool = False,
    timeline: dict | None = None,
    logprobs: dict | None = None,
) -> dict[str, Any]:
    """One SSE chunk: a token's text (possibly empty), or the final chunk with finish_reason (which
    carries the timeline when no usage chunk follows, so clients never see an extra chunk).
    `logprobs`: those of the tokens this chunk carries (echo: the prompt's on the first chunk)."""
    if p.kind == "completion":
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text or finish_reason is None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    out = {**_head(p, rid, created, True), "choices": [choice]}
    if timeline is not None:
        out["pdserve"] = {"timeline": json_safe(timeline)}
    return out


def usage_chunk(p: Prepared, rid: str, created: int, use: dict[str, int], timeline: dict | None) -> dict[str, Any]:
    """The last chunk before [DONE] with stream_options.include_usage: usage and the timeline."""
    return {**_head(p, rid, created, True), "choices": [], "usage": use, "pdserve": {"timeline": json_safe(timeline)}}


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), allow_nan=False)}\n\n"


def now_created() -> int:
    return int(time.time())
