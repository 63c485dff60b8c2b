"""The HTTP face of pdserve: an OpenAI-compatible FastAPI app over an Orchestrator.

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE or JSON), GET /v1/models,
GET /v1/requests/{id}/timeline, GET /metrics (Prometheus), GET /health (never behind the API key).

A request's life here: validate (4xx, nothing dispatched) -> admit (429 if the queue is full)
-> a pump task feeds the orchestrator's token events to the response -> the response ends, the
client leaves or a worker fails -> `_Run.close()` frees the queue slot, records metrics, and
aborts the request on the workers if they still hold it. The pump is a separate task on purpose:
when Starlette cancels a streaming response (client gone), that cancellation must not land inside
the orchestrator's generator, whose cleanup has to run to completion.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from contracts.worker import GenerateRequest, WorkerError
from engine.sequence import TokenLogprob
from engine.tokenizer import Detokenizer, Tokenizer
from router import logprobs_format as lpf
from router import logs
from router import openai_protocol as oa
from router import openai_responses as oar
from router.config import ServeConfig
from router.metrics import ServeMetrics
from router.tracing import Tracing, trace_ids
from router.tracing import enabled as tracing_enabled

log = logging.getLogger("pdserve.app")
DISCONNECT_POLL_S = 0.25
_END = object()  # end of a pump's event queue


class ServerState:
    """What every endpoint shares. `orchestrator` is None until the lifespan has built it."""

    def __init__(self, orchestrator: Any, tokenizer: Tokenizer, cfg: ServeConfig):
        self.orchestrator, self.tokenizer, self.cfg = orchestrator, tokenizer, cfg
        self.metrics = ServeMetrics()
        self.tracing = Tracing(cfg.otlp_endpoint, cfg.chunk_size) if tracing_enabled(cfg.otlp_endpoint) else None
        if self.tracing is not None:
            self.metrics.span_counts = self.tracing.counts
        self.inflight = 0  # admitted and not closed; counted here so admission is atomic
        self.runs: set[_Run] = set()  # the admitted requests still open
        self.draining = False  # shutting down: new requests get 503, open ones may finish
        self.started = int(time.time())
        self._tasks: set[asyncio.Task] = set()

    def orch(self) -> Any:
        if self.orchestrator is None:
            raise oa.OpenAIError(
                503, "The server is starting; try again shortly.", type="server_error", code="not_ready"
            )
        return self.orchestrator

    def limits(self) -> oa.Limits:
        mc = self.orch().model_config
        # A request that cannot fit one worker's KV pool would wait for blocks forever.
        kv_tokens = self.cfg.num_blocks * self.cfg.block_size
        return oa.Limits(
            self.cfg.model_name,
            frozenset(self.cfg.accepted_model_names()),
            min(mc.max_position_embeddings, kv_tokens),
            mc.vocab_size,
            self.cfg.max_tokens_limit,
        )

    def end_open_runs(self, message: str) -> int:
        """End every open request with `message` as its error (streams: an error event, then
        [DONE]) and stop it on the workers. Returns how many were open."""
        runs = list(self.runs)
        for run in runs:
            run.q.put_nowait(WorkerError(message))
            run.stop()
        return len(runs)

    def spawn(self, coro: Awaitable[Any], what: str) -> None:
        """Fire and forget (but keep a reference and log failures): cleanup that must outlive a
        cancelled request task."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("%s failed: %r", what, t.exception())

        task.add_done_callback(done)


class _Run:
    """One admitted request, from the orchestrator's token events to text pieces."""

    def __init__(self, st: ServerState, p: oa.Prepared, t_arrival: float, t_http_ns: int = 0):
        self.st, self.p, self.t0 = st, p, t_arrival
        self.t_http_ns = t_http_ns or time.time_ns()  # wall clock at the HTTP request: the trace's start
        self.span: Any = None  # the request's root span, when tracing is on
        self.error: str | None = None  # why it failed, for its trace and its log line
        self.rid = oar.new_request_id(p.kind)
        self.created = oar.now_created()
        self.req = GenerateRequest(self.rid, p.prompt_ids, p.params)
        self.q: asyncio.Queue[Any] = asyncio.Queue()
        self.token_times: list[float] = []
        self.finish_reason: str | None = None  # set once the request ended normally
        self.failed = False
        self.disconnected = False
        self.closed = False
        self.orch_done = False  # the orchestrator delivered the last token: nothing to abort
        self.pump: asyncio.Task | None = None
        self.logprobs: list[TokenLogprob] = []  # of the generated tokens, when asked
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # echo with logprobs
        self._lp_sent = 0  # logprobs already put in a response chunk
        self._text_sent = 0  # characters of text (echoed prompt included) already sent: text offsets
        st.runs.add(self)

    async def _pump(self) -> None:
        try:
            async for ev in self.st.orch().generate(self.req):
                self.q.put_nowait(ev)
                if ev.finished:
                    self.orch_done = True
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which answers the client
            self.q.put_nowait(e)
        finally:
            self.q.put_nowait(_END)

    async def pieces(self) -> AsyncIterator[str]:
        """Text per generated token ('' while a character or a possible stop string is incomplete).
        Sets `finish_reason` when the request ends normally; raises WorkerError on failure."""
        detok, stops = Detokenizer(self.st.tokenizer), oar.StopFilter(self.p.stop)
        self.pump = asyncio.ensure_future(self._pump())
        while True:
            item = await self.q.get()
            if item is _END:
                if self.finish_reason is None and not self.disconnected:
                    raise WorkerError("the request ended before its last token")
                return
            if isinstance(item, BaseException):
                raise item
            if item.kind == "error":
                raise WorkerError(item.error or "worker error")
            if item.kind != "token":
                continue
            self.token_times.append(time.perf_counter())
            if item.logprob is not None:
                self.logprobs.append(item.logprob)
            if item.prompt_logprobs is not None:
                self.prompt_logprobs = item.prompt_logprobs
            text = stops.push(detok.push(item.token_id))
            if item.finished and not stops.stopped:
                text += stops.push(detok.flush())
                text += "" if stops.stopped else stops.finish()
            yield text
            if stops.stopped or item.finished:
                self.finish_reason = "stop" if stops.stopped else item.finish_reason
                if self.finish_reason not in ("stop", "length"):
                    raise WorkerError(f"the request ended with {item.finish_reason!r}: {item.error or ''}".strip())
                return

    async def watch(self, request: Request) -> None:
        """Poll for a client that went away (non-streaming responses, or a stream waiting on a
        slow first token); stop the request at once."""
        while not self.closed:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                self.disconnected = True
                self.stop()
                self.q.put_nowait(_END)
                return

    def stop(self) -> None:
        """Abort on both pools (the contract: a consumer that stops iterating calls abort)."""
        if self.orch_done or self.pump is None or self.pump.done():
            return  # finished, never started, or the orchestrator already cleaned up after itself
        orch, rid, pump = self.st.orch(), self.rid, self.pump

        async def abort() -> None:
            try:
                await orch.abort(rid)
            finally:
                pump.cancel()

        self.orch_done = True  # abort once
        self.st.spawn(abort(), f"abort of {rid}")

    def take_logprobs(self, text: str, first: bool) -> dict[str, Any] | None:
        """The logprobs object for a response (or chunk) carrying `text`: the tokens received since
        the last call, and on the first call the echoed prompt's. None when not asked."""
        p, tok = self.p, self.st.tokenizer
        if p.logprobs is None:
            return None
        new, self._lp_sent = self.logprobs[self._lp_sent :], len(self.logprobs)
        if p.kind == "chat":
            return lpf.chat_logprobs(list(new), tok)
        out = lpf.completion_logprobs(list(new), tok)
        if first and p.echo and self.prompt_logprobs:
            echoed = lpf.merge_completion(
                lpf.first_prompt_entry(p.prompt_ids, tok), lpf.completion_logprobs(self.prompt_logprobs[1:], tok)
            )
            out = lpf.merge_completion(echoed, out)
        out["text_offset"] = list(_offsets(out["tokens"], self._text_sent))
        self._text_sent += len(text)
        return out

    @property
    def completion_tokens(self) -> int:
        return len(self.token_times)

    def usage(self) -> dict[str, int]:
        return oar.usage(len(self.p.prompt_ids), self.completion_tokens)

    def close(self) -> None:
        """Exactly once, however the request ended: free the slot, abort if needed, record metrics."""
        if self.closed:
            return
        self.closed = True
        self.stop()
        self.st.inflight -= 1
        self.st.runs.discard(self)
        status = "ok" if self.finish_reason and not self.failed else "error" if self.failed else "aborted"
        t, end_ns = self.token_times, time.time_ns()
        orch = self.st.orchestrator
        tl = orch.timeline(self.rid) if orch is not None else None
        self.st.metrics.observe_request(
            status,
            t[0] - self.t0 if t else None,
            [b - a for a, b in zip(t, t[1:])],
            t[-1] - self.t0 if t else None,
            len(t),
            timeline=tl,
        )
        if self.span is not None and self.st.tracing is not None:
            self.st.tracing.finish(self.span, tl, self.t_http_ns, end_ns, status, self.error)
        logs.request_ended(
            log,
            self.rid,
            status,
            len(self.p.prompt_ids),
            len(t),
            (t[0] - self.t0) * 1e3 if t else None,
            (end_ns - self.t_http_ns) / 1e6,
            self.finish_reason,
        )


def _offsets(tokens: list[str], start: int) -> list[int]:
    out = []
    for t in tokens:
        out.append(start)
        start += len(t)
    return out


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


async def _sse_events(run: _Run, request: Request) -> AsyncIterator[str]:
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
        tl = run.st.orch().timeline(rid)
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


async def _complete(run: _Run, request: Request) -> Response:
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
        run.st.orch().timeline(run.rid),
        logprobs=run.take_logprobs(full_text, True),
    )
    return JSONResponse(body, headers={"X-Request-Id": run.rid})


def create_app(orchestrator: Any, tokenizer: Tokenizer, cfg: ServeConfig, *, lifespan: Any = None) -> FastAPI:
    """The app over a ready `orchestrator`, or over None with a `lifespan` that sets
    `app.state.pd.orchestrator` once the pools are up (what `pdserve serve` does)."""
    app = FastAPI(title="pdserve", version="0.1.0", lifespan=lifespan)
    st = app.state.pd = ServerState(orchestrator, tokenizer, cfg)

    async def auth(request: Request) -> None:
        if cfg.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), cfg.api_key.encode()):
            raise oa.OpenAIError(
                401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key"
            )

    protected = [Depends(auth)]

    @app.exception_handler(oa.OpenAIError)
    async def _openai_error(request: Request, e: oa.OpenAIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        err = (e.errors() or [{}])[0]
        param = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or None
        return JSONResponse(oa.error_body(f"Invalid request: {err.get('msg', e)}", param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(oa.error_body(str(e.detail), kind), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(
            oa.error_body(f"Internal server error: {type(e).__name__}", "server_error"), status_code=500
        )

    async def generate(request: Request, kind: str) -> Response:
        t_arrival, t_http_ns = time.perf_counter(), time.time_ns()
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
        run = _Run(st, p, t_arrival, t_http_ns)
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

    @app.post("/v1/completions", dependencies=protected)
    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    @app.post("/v1/chat/completions", dependencies=protected)
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    @app.get("/v1/models", dependencies=protected)
    async def models() -> dict[str, Any]:
        lim = st.limits()
        return {
            "object": "list",
            "data": [
                {
                    "id": cfg.model_name,
                    "object": "model",
                    "created": st.started,
                    "owned_by": "pdserve",
                    "max_model_len": lim.context_len,
                }
            ],
        }

    @app.get("/v1/requests/{request_id}/timeline", dependencies=protected)
    async def timeline(request_id: str) -> dict[str, Any]:
        tl = st.orch().timeline(request_id)
        if tl is None:
            raise oa.OpenAIError(
                404,
                f"No timeline for request '{request_id}' (unknown, or too old).",
                param="request_id",
                code="request_not_found",
            )
        return oar.json_safe(tl)

    @app.get("/v1/workers/steps", dependencies=protected)
    async def worker_steps() -> dict[str, Any]:
        """Each worker's last steps (shape and seconds): what `bench compare` fits its step-cost
        model to, so a prediction is calibrated on the very server it predicts."""
        stats = await st.orch().stats()
        return {"object": "list", "data": [s.step_log() for s in stats]}

    @app.get("/metrics", dependencies=protected)
    async def metrics() -> Response:
        if st.orchestrator is not None:
            await st.metrics.refresh(st.orchestrator)
        data, ctype = st.metrics.render()
        return Response(data, media_type=ctype)

    @app.get("/health")
    async def health() -> JSONResponse:
        if st.orchestrator is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        if st.draining:
            return JSONResponse({"status": "draining", "inflight": st.inflight}, status_code=503)
        pools = st.orchestrator.pool_status()
        degraded = any(p["live"] < p["configured"] for p in pools.values())
        return JSONResponse(
            {
                "status": "degraded" if degraded else "ok",
                "mode": st.orchestrator.mode,
                "model": cfg.model_name,
                "inflight": st.inflight,
                "pools": pools,
            },
            status_code=503 if degraded else 200,
        )

    return app
