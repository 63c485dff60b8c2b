"""One generation request through the HTTP layer, shared by /v1/completions and
/v1/chat/completions: validate (4xx, nothing dispatched) -> admit (429 if the queue is full) ->
answer as an SSE stream or as one JSON body, closing the admitted request however it ends."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from contracts.worker import WorkerError
from router.http.admitted_request import AdmittedRequest
from router.http.state import server_state
from router.observe import logs
from router.observe.timeline import Timeline
from router.observe.tracing import trace_ids
from router.openai import protocol as oa
from router.openai import responses as oar

log = logging.getLogger("pdserve.app")


async def generate(request: Request, kind: Literal["completion", "chat"]) -> Response:
    """Admit the request (or raise the OpenAIError that refuses it) and start answering it."""
    t_arrival, t_http_ns = time.perf_counter(), time.time_ns()
    st = server_state(request)
    cfg = st.cfg
    try:
        if st.draining:
            raise oa.OpenAIError(
                503, "The server is shutting down; send the request elsewhere.", type="server_error",
                code="shutting_down",
            )  # fmt: skip
        lim = st.limits()
        body = oa.parse_json(await request.body())
        prepare = oa.prepare_completion if kind == "completion" else oa.prepare_chat
        p = prepare(body, st.tokenizer, lim)
        orch = st.orch()
        # No await between this check and the increment: admission is atomic in the event loop.
        if st.inflight >= cfg.max_queue or orch.queue_depth() >= cfg.max_queue:
            raise oa.OpenAIError(
                429,
                f"The server's queue is full ({cfg.max_queue} requests); retry later.",
                type="rate_limit_error",
                code="queue_full",
            )
    except oa.OpenAIError:
        st.metrics.requests.labels("rejected").inc()
        raise
    st.inflight += 1
    run = AdmittedRequest(st, p, t_arrival, t_http_ns)
    # Set in this task's context: the response body runs in it, and the tasks it starts copy it.
    logs.request_id.set(run.rid)
    if st.tracing is not None:
        run.span = st.tracing.start(
            request.headers,
            f"{request.method} {request.url.path}",
            t_http_ns,
            {
                "pdserve.request_id": run.rid,
                "gen_ai.request.max_tokens": p.params.max_tokens,
                "pdserve.stream": p.stream,
            },
        )
        logs.set_trace(*trace_ids(run.span))
    st.metrics.prompt_tokens.inc(len(p.prompt_ids))
    if p.stream:
        return _ClosingStream(
            _sse_events(run, request),
            run.close,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": run.rid},
        )
    return await _complete(run, request)


class _ClosingStream(StreamingResponse):
    """Calls `on_close` when the response is over, even if its body generator never started
    (a client that left before the first byte)."""

    def __init__(self, content: AsyncIterator[str], on_close: Any, **kw: Any):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _sse_events(run: AdmittedRequest, request: Request) -> AsyncIterator[str]:
    p, rid, created = run.p, run.rid, run.created
    watcher = asyncio.ensure_future(run.watch(request))
    first = True
    try:
        async for text in run.pieces():
            if first and p.echo:
                text = p.prompt_text + text
            yield oar.sse(oar.stream_chunk(p, rid, created, text, None, first, logprobs=run.take_logprobs(text, first)))
            first = False
        if run.finish_reason is None:  # the client left; nobody to tell
            return
        tl = _timeline_json(run.st.orch().timeline(rid))
        yield oar.sse(
            oar.stream_chunk(
                p, rid, created, "", run.finish_reason, first, timeline=None if p.include_usage else (tl or {})
            )
        )
        if p.include_usage:
            yield oar.sse(oar.usage_chunk(p, rid, created, run.usage(), tl))
    except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band, like vLLM
        run.failed, run.error = True, str(e)
        if isinstance(e, WorkerError):
            log.error("request %s failed: %s", rid, e)
        else:
            log.exception("request %s failed", rid)
        yield oar.sse(oa.error_body(f"The request failed: {e}", "server_error", code="worker_error"))
    finally:
        watcher.cancel()
    yield oar.SSE_DONE


async def _complete(run: AdmittedRequest, request: Request) -> Response:
    watcher = asyncio.ensure_future(run.watch(request))
    try:
        text = "".join([t async for t in run.pieces()])
    except WorkerError as e:
        run.failed, run.error = True, str(e)
        log.error("request %s failed: %s", run.rid, e)
        raise oa.OpenAIError(500, f"The request failed: {e}", type="server_error", code="worker_error") from None
    except Exception as e:
        run.failed, run.error = True, repr(e)
        raise
    finally:
        watcher.cancel()
        run.close()
    if run.finish_reason is None:  # the client left
        return Response(status_code=499)
    full_text = run.p.prompt_text + text if run.p.echo else text
    body = oar.full_response(
        run.p,
        run.rid,
        run.created,
        text,
        run.finish_reason,
        run.usage(),
        _timeline_json(run.st.orch().timeline(run.rid)),
        logprobs=run.take_logprobs(full_text, True),
    )
    return JSONResponse(body, headers={"X-Request-Id": run.rid})


def _timeline_json(tl: Timeline | None) -> dict[str, Any] | None:
    """A response's `pdserve.timeline`: the typed timeline's JSON form, made here at the wire."""
    return tl.to_dict() if tl is not None else None
