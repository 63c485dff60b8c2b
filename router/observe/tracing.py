"""OpenTelemetry traces of requests, exported over OTLP/HTTP: one trace per request.

Off unless `--otlp-endpoint URL` is given or a standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` /
`OTEL_EXPORTER_OTLP_ENDPOINT` variable is set (`OTEL_SDK_DISABLED=true` or
`OTEL_TRACES_EXPORTER=none` turn it off again); the exporter reads the other `OTEL_EXPORTER_OTLP_*`
variables (headers, timeout, compression) itself, and `OTEL_SERVICE_NAME` names the service.

Off the hot path by construction: the request's root span is opened when the request is admitted
(so its trace id is known at once, for the logs and for a client's `traceparent` to be honoured),
and every other span is built after the request ended, from the timeline's stamps with explicit
start and end times (router/observe/trace_phases.py). The workers' phases (queue, prefill, KV transfer,
decode) are therefore spans the router writes from the times the workers reported, not spans the
workers emit: no trace context crosses the Ray calls, and a worker costs nothing per step. With
layer-wise KV transfer the workers' per-group stamps come back the same way (a few floats per group
in the prefill's result and the decode admission's transfer stats): each group's forward pass is a
child of the prefill span, and each group's pull a child of the request's span, overlapping the
prefill.
Spans leave through a BatchSpanProcessor (a bounded queue and a background thread): a collector
that is down or slow costs only dropped spans, which `pdserve_trace_spans_dropped_total` counts.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from router.observe import trace_phases
from router.observe.timeline import Timeline

log = logging.getLogger("pdserve.tracing")
# ~10 spans a request (layer-wise: two more per group of layers and prefill chunk): the last ~800
# bulk requests wait here while a collector is slow
MAX_QUEUE_SPANS = 8192
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TimelineIn = Timeline | Mapping[str, Any]  # a request's timeline, typed or as the API's JSON


def enabled(endpoint: str | None, env: Mapping[str, str] = os.environ) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true" or env.get("OTEL_TRACES_EXPORTER", "") == "none":
        return False
    return bool(endpoint) or any(env.get(v) for v in _ENDPOINT_VARS)


def traces_url(endpoint: str) -> str:
    """A collector's base URL (http://host:4318) gets OTLP's trace path, as OTEL_EXPORTER_OTLP_ENDPOINT
    does; a URL with a path is used as given."""
    return endpoint.rstrip("/") + "/v1/traces" if urlparse(endpoint).path in ("", "/") else endpoint


class _CountingExporter(SpanExporter):
    """Counts what the wrapped exporter was handed, what it delivered and what it failed to (after
    its own retries)."""

    def __init__(self, inner: SpanExporter):
        self.inner, self.handed, self.exported, self.failed = inner, 0, 0, 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.handed += len(spans)  # out of the queue from here on, delivered or not
        try:
            r = self.inner.export(spans)
        except Exception as e:  # noqa: BLE001 - a broken collector must not kill the export thread
            log.debug("span export failed: %r", e)
            r = SpanExportResult.FAILURE
        if r == SpanExportResult.SUCCESS:
            self.exported += len(spans)
        else:
            self.failed += len(spans)
        return r

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _CountingProcessor(SpanProcessor):
    """In front of the BatchSpanProcessor, a bound of its own on the spans waiting for export: a
    sampled span that finds `max_queue` of them waiting (handed to the batch processor, not yet to
    the exporter) is dropped here and counted. The SDK drops from a full queue too, but counts
    nothing we could export, and its queue is not public API; with this bound at or below the
    SDK's queue size, the SDK's queue never fills, so every dropped span is one counted here."""

    def __init__(self, inner: BatchSpanProcessor, exporter: _CountingExporter, max_queue: int):
        self.inner, self.exporter, self.max_queue = inner, exporter, max_queue
        self.forwarded = self.overflow = 0  # only the event loop's thread ends spans: no lock needed

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self.inner.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        if not (span.context is not None and span.context.trace_flags.sampled):
            self.inner.on_end(span)  # not queued: the batch processor ignores it
            return
        # `handed` lags the export thread's take from the queue by a moment: the waiting count is
        # never underestimated, so the SDK's queue never overflows
        if self.forwarded - self.exporter.handed >= self.max_queue:
            self.overflow += 1
            return
        self.forwarded += 1
        self.inner.on_end(span)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class Tracing:
    """One app's tracer provider (not the global one: several apps may share a process in tests)."""

    def __init__(
        self,
        endpoint: str | None,
        chunk_size: int | None = None,
        max_queue: int = MAX_QUEUE_SPANS,
        exporter: SpanExporter | None = None,  # instead of OTLP's (benchmarks/tracing_cost.py)
    ):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415 - only when tracing is on
            OTLPSpanExporter,
        )

        self.chunk_size = chunk_size
        if exporter is None:
            exporter = OTLPSpanExporter(endpoint=traces_url(endpoint) if endpoint else None)
        self._exporter = _CountingExporter(exporter)
        self._processor = _CountingProcessor(
            BatchSpanProcessor(
                self._exporter,
                max_queue_size=max_queue,
                schedule_delay_millis=500,
                max_export_batch_size=min(512, max_queue),
            ),
            self._exporter,
            max_queue,
        )
        self.provider = TracerProvider(resource=Resource.create({"service.name": "pdserve"}))
        self.provider.add_span_processor(self._processor)
        self.tracer = self.provider.get_tracer("pdserve.router")
        self._propagator = TraceContextTextMapPropagator()

    def counts(self) -> tuple[int, int]:
        """(spans exported, spans dropped) so far."""
        return self._exporter.exported, self._exporter.failed + self._processor.overflow

    def start(self, headers: Mapping[str, str], name: str, start_ns: int, attributes: dict[str, Any]) -> Span:
        """The request's root span; a W3C `traceparent` header makes it a child of the client's span."""
        ctx = self._propagator.extract(dict(headers))
        span = self.tracer.start_span(name, ctx, SpanKind.SERVER, attributes, start_time=start_ns)
        assert isinstance(span, Span)  # the SDK's, not the API's no-op
        return span

    def finish(
        self,
        root: Span,
        tl: TimelineIn | None,
        http_arrival_ns: int,
        end_ns: int,
        status: str,
        error: str | None,
    ) -> None:
        """Write the request's spans from its timeline and end the root span."""
        try:
            if tl is not None:
                self._children(root, tl, http_arrival_ns, end_ns, status, error)
            elif status != "ok":
                root.add_event("error", {"message": error or status}, timestamp=end_ns)
            root.set_attribute("pdserve.status", status)
            if status != "ok":
                root.set_status(Status(StatusCode.ERROR, error or status))
        except Exception:  # noqa: BLE001 - tracing must never fail a request
            log.exception("building the trace of a request failed")
        finally:
            root.end(end_time=end_ns)

    def _children(self, root: Span, tl: TimelineIn, t0: int, t1: int, status: str, error: str | None) -> None:
        rt = trace_phases.build(tl, t0, t1, status, error, self.chunk_size)
        ctx = trace.set_span_in_context(root)
        for p in [*rt.phases, *([rt.stream] if rt.stream else []), *rt.overlapping]:
            failed = rt.error if rt.error is not None and p is rt.phases[-1] else None  # the phase it ended in
            self._span(p, ctx, failed)
        for name, t, attrs in rt.events:
            root.add_event(name, attrs, timestamp=t)
        root.set_attributes(rt.root)
        if rt.error is not None:
            kind = "aborted" if status == "aborted" else "error"
            root.add_event(kind, {"message": rt.error, "pdserve.died": "died" in rt.error}, timestamp=t1)

    def _span(self, p: trace_phases.Phase, ctx: Context, error: str | None = None) -> None:
        """Phase `p` as a span under `ctx`'s, its children under it, all with their own times."""
        span = self.tracer.start_span(p.name, ctx, attributes=p.attributes, start_time=p.start_ns)
        if p.children:
            inner = trace.set_span_in_context(span)
            for c in p.children:
                self._span(c, inner)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=p.end_ns)

    def shutdown(self) -> None:
        """Flush what is queued (bounded by the exporter's timeout) and stop the export thread."""
        self.provider.shutdown()


def trace_ids(span: Any) -> tuple[str, str]:
    """(trace id, span id) as the 32 and 16 hex digits logs and W3C headers use."""
    c = span.get_span_context()
    return format(c.trace_id, "032x"), format(c.span_id, "016x")
