"""Server logs as text or as JSON lines (`--log-format json`), carrying the request and trace ids.

The ids live in context variables set when a request is admitted; asyncio copies the context into
every task the request starts (its pump, its abort), so a line logged anywhere on a request's
behalf, the orchestrator included, names the request, and with tracing on its trace: logs,
traces and `/v1/requests/{id}/timeline` join on them.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any

LOG_FORMATS = ("text", "json")
request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_request_id", default=None)
trace_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_trace_id", default=None)
span_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_span_id", default=None)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The attributes every LogRecord has; anything else was passed with `extra=` and is a field of its own.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class ContextFilter(logging.Filter):
    """Stamps the current request's ids on every record (None outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, var in (("request_id", request_id), ("trace_id", trace_id), ("span_id", span_id)):
            if not hasattr(record, name):
                setattr(record, name, var.get())
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601), level, logger, message, the ids when set,
    `extra=` fields, and the traceback as `exc_info`."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _STANDARD and v is not None:
                out[k] = v
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def set_trace(trace: str, span: str) -> None:
    trace_id.set(trace)
    span_id.set(span)


def request_ended(
    log: logging.Logger,
    rid: str,
    status: str,
    prompt_tokens: int,
    completion_tokens: int,
    ttft_ms: float | None,
    e2e_ms: float,
    finish_reason: str | None,
) -> None:
    """The line a request logs when it ends: at debug, since one line per request at info would
    flood a benchmark's log (uvicorn's access log is off for the same reason)."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    log.debug(
        "request %s %s: %d prompt + %d generated tokens in %.1f ms",
        rid,
        status,
        prompt_tokens,
        completion_tokens,
        e2e_ms,
        extra={
            "status": status,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "ttft_ms": None if ttft_ms is None else round(ttft_ms, 3),
            "e2e_ms": round(e2e_ms, 3),
            "finish_reason": finish_reason,
        },
    )


def setup(level: str, fmt: str = "text") -> None:
    """Configure the root logger of the server process (uvicorn's loggers propagate to it)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
