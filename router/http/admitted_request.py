"""`AdmittedRequest`: one request the app has admitted, from the orchestrator's token events to
text pieces, until it is closed exactly once.

Its life: a pump task feeds the orchestrator's token events into a queue -> `pieces()` turns them
into text -> the response ends, the client leaves or a worker fails -> `close()` frees the queue
slot, records metrics, and aborts the request on the workers if they still hold it. The pump is a
separate task on purpose: when Starlette cancels a streaming response (client gone), that
cancellation must not land inside the orchestrator's generator, whose cleanup has to run to
completion.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from contracts.worker import GenerateRequest, WorkerError
from engine.checkpoint.tokenizer import Detokenizer
from engine.sequence import TokenLogprob
from router.http.state import ServerState
from router.observe import logs
from router.openai import logprobs_format as lpf
from router.openai import protocol as oa
from router.openai import responses as oar

log = logging.getLogger("pdserve.app")
DISCONNECT_POLL_S = 0.25
_END = object()  # end of a pump's event queue


class AdmittedRequest:
    """One admitted request, from the orchestrator's token events to text pieces."""

    def __init__(self, st: ServerState, p: oa.Prepared, t_arrival: float, t_http_ns: int = 0):
        self.st, self.p, self.t0 = st, p, t_arrival
        self.t_http_ns = t_http_ns or time.time_ns()  # wall clock at the HTTP request: the trace's start
        self.span: Any = None  # the request's root span, when tracing is on
        self.error: str | None = None  # why it failed, for its trace and its log line
        self.rid = oar.new_request_id(p.kind)
        self.created = oar.now_created()
        self.req = GenerateRequest(self.rid, p.prompt_ids, p.params, kv_transfer=p.kv_transfer)
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

    def fail(self, message: str) -> None:
        """End the request with `message` as its error (a stream gets an error event, then
        [DONE]) and stop it on the workers: what a shutdown does to the requests still open."""
        self.q.put_nowait(WorkerError(message))
        self.stop()

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

    def usage(self) -> dict[str, Any]:
        # the prefix hit where the prompt was computed (a prefill worker, or the decode worker that
        # prefilled it): what the request did not pay for
        orch = self.st.orchestrator
        tl = orch.timeline(self.rid) if orch is not None else None
        cached = tl.prefill_cached_tokens if tl is not None else None
        return oar.usage(len(self.p.prompt_ids), self.completion_tokens, cached)

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
