"""Serving metrics from recorded request events: pure functions, no I/O, no clock.

All times are seconds on the client's monotonic clock, relative to the benchmark start. For a
request r the client records: send time s_r, the arrival time c_1 < ... < c_k of every streamed
chunk that carried output, the end time e_r (stream closed), and the server's usage counts.

Per request (successful requests only, like vLLM's bench serve and AIPerf):
  n_out  = usage.completion_tokens if the server reported it, else k (one token per chunk)
  TTFT   = c_1 - s_r
  E2E    = e_r - s_r
  TPOT   = (E2E - TTFT) / (n_out - 1)              defined only when n_out >= 2
  ITL    = [c_{i+1} - c_i for i = 1..k-1]          one gap per chunk: a chunk carrying several
                                                   tokens is one gap (vLLM's convention); TPOT
                                                   uses the token count, so it is not fooled.
Distributions: mean, p50, p90, p99 over requests (TTFT, TPOT, E2E) or over all gaps of all
requests pooled (ITL). Percentiles interpolate linearly between closest ranks, as numpy does:
  h = (n - 1) * q / 100,  p_q = x[floor h] + (h - floor h) * (x[floor h + 1] - x[floor h]).

Run-level:
  D                   = max e_r - min s_r over all sent requests (the benchmark's duration)
  request throughput  = completed / D
  output throughput   = sum n_out / D;  total token throughput = sum (prompt tokens + n_out) / D
  goodput             = #{completed r : TTFT_r <= SLO_ttft and (n_out < 2 or TPOT_r <= SLO_tpot)} / D
                        (an SLO left unset is not checked; no SLO at all: goodput is None)

The article's metric, the stall. For each completed document d with first token f_d:
  window         W_d = [s_d, f_d]   (from the document's send to its first token)
  in flight      streams r != d with c_1^r < s_d < c_k^r and k >= 2: already decoding when the
                 document arrived and not yet finished
  gap_r          longest ITL (c_i, c_{i+1}) of r with c_{i+1} > s_d and c_i < f_d: the longest
                 silence r saw while d was being admitted and prefilled
  stall(d)       max over in-flight r of gap_r
  lost_r         max(0, gap_r / median ITL of r - 1): tokens r would have produced in that
                 silence at its own typical pace, minus the one token the gap delivers anyway
  tokens_lost(d) sum over in-flight r of lost_r   (aggregate progress lost, as the article's
                 "32 streams x 29 tokens = 915 tokens")
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import median


@dataclass
class RequestRecord:
    """What the client saw of one request. Times relative to the benchmark start, in seconds."""

    request_id: str
    kind: str
    prompt_len: int  # intended prompt tokens (workload)
    max_tokens: int
    scheduled_s: float  # arrival offset from the workload
    send_s: float | None = None  # None: never sent (duration limit hit first)
    chunk_times_s: list[float] = field(default_factory=list)
    end_s: float | None = None
    prompt_tokens: int | None = None  # usage, when the server reports it
    completion_tokens: int | None = None  # usage, when the server reports it
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    dispatch: dict | None = None  # pdserve --mode auto: the router's decision and predictions (timeline)
    # the worker's own time for the prompt (pdserve timeline): waiting for its first step, and
    # from its first prefill step to its first token; ms
    worker_queue_ms: float | None = None
    worker_prefill_ms: float | None = None
    router_ttft_ms: float | None = None  # arrival at the router to its first token event (timeline)
    transfer: dict | None = None  # pdserve disagg: this request's KV pull (bytes, ms, rate; timeline)
    # pdserve disagg: prefill end to decode admission, less the pull (timeline); ms
    decode_wait_ms: float | None = None
    # pdserve: each token's decode-step end at its worker (timeline), on this record's clock
    # (server wall clock mapped at the end of the stream: valid when client and server share a host)
    step_end_times_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and self.send_s is not None and self.end_s is not None and bool(self.chunk_times_s)

    @property
    def n_out(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times_s)

    @property
    def n_in(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] - self.send_s  # type: ignore[operator]

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.send_s  # type: ignore[operator]

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.n_out - 1) if self.n_out >= 2 else None

    @property
    def itls_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def serving_overheads_s(self) -> list[float]:
        """Per token: its step's end at the worker to its chunk at the client (the worker's
        event hop, the router, SSE and the socket). Only where chunks and tokens pair one to one."""
        if len(self.step_end_times_s) != len(self.chunk_times_s):
            return []
        return [c - s for s, c in zip(self.step_end_times_s, self.chunk_times_s)]


@dataclass(frozen=True)
class Dist:
    """A distribution summary; values in the unit of the field name it is stored under."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


@dataclass(frozen=True)
class StreamStall:
    request_id: str
    gap_s: float
    median_itl_s: float
    tokens_lost: float


@dataclass(frozen=True)
class DocumentStall:
    request_id: str
    arrival_s: float
    first_token_s: float
    ttft_s: float
    stall_s: float | None  # None when no stream was in flight
    tokens_lost: float
    streams: list[StreamStall]


@dataclass(frozen=True)
class ServeMetrics:
    num_requests: int
    completed: int
    failed: int
    not_sent: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # requests/s
    output_throughput: float  # tokens/s
    total_token_throughput: float  # tokens/s
    ttft_ms: Dist
    tpot_ms: Dist
    itl_ms: Dist
    e2e_ms: Dist
    ttft_ms_by_kind: dict[str, Dist]
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    slo_met: int | None
    goodput: float | None  # requests/s meeting the SLO
    stall_ms: Dist  # one value per document with streams in flight
    tokens_lost: Dist  # one value (sum over streams) per such document
    documents: list[DocumentStall]
    # per token, step end at the worker -> chunk at the client (pdserve servers; see RequestRecord)
    serving_overhead_ms: Dist = field(default_factory=lambda: summarize([]))


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    h = (len(xs) - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def summarize(values: Sequence[float], scale: float = 1.0) -> Dist:
    """Dist of values * scale (scale=1000 turns seconds into ms)."""
    xs = [v * scale for v in values]
    if not xs:
        return Dist(0, None, None, None, None, None)
    return Dist(len(xs), sum(xs) / len(xs), percentile(xs, 50), percentile(xs, 90), percentile(xs, 99), max(xs))


def benchmark_duration(records: Sequence[RequestRecord]) -> float:
    sent = [(r, r.send_s) for r in records if r.send_s is not None]
    if not sent:
        return 0.0
    ends = [r.end_s if r.end_s is not None else (r.chunk_times_s[-1] if r.chunk_times_s else t) for r, t in sent]
    return max(ends) - min(t for _, t in sent)


def meets_slo(r: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if slo_ttft_ms is not None and r.ttft_s * 1000.0 > slo_ttft_ms:
        return False
    tpot = r.tpot_s
    return not (slo_tpot_ms is not None and tpot is not None and tpot * 1000.0 > slo_tpot_ms)


def document_stall(doc: RequestRecord, records: Sequence[RequestRecord]) -> DocumentStall:
    """The stall the in-flight streams saw while `doc` was admitted and prefilled (see module doc)."""
    a, f = doc.send_s, doc.chunk_times_s[0]
    assert a is not None
    streams = []
    for r in records:
        if r is doc or not r.ok or len(r.chunk_times_s) < 2:
            continue
        t = r.chunk_times_s
        if not (t[0] < a < t[-1]):
            continue
        overlapping = [b - x for x, b in zip(t, t[1:]) if b > a and x < f]
        if not overlapping:
            continue
        gap, med = max(overlapping), median(r.itls_s)
        lost = max(0.0, gap / med - 1.0) if med > 0 else 0.0
        streams.append(StreamStall(r.request_id, gap, med, lost))
    stall = max((s.gap_s for s in streams), default=None)
    return DocumentStall(doc.request_id, a, f, f - a, stall, sum(s.tokens_lost for s in streams), streams)


def compute_metrics(
    records: Sequence[RequestRecord], slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None
) -> ServeMetrics:
    done = [r for r in records if r.ok]
    not_sent = sum(1 for r in records if r.send_s is None)
    duration = benchmark_duration(records)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    n_in = sum(r.n_in for r in done)
    n_out = sum(r.n_out for r in done)

    kinds = sorted({r.kind for r in done})
    by_kind = {k: summarize([r.ttft_s for r in done if r.kind == k], 1000.0) for k in kinds}

    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    met = sum(1 for r in done if meets_slo(r, slo_ttft_ms, slo_tpot_ms)) if has_slo else None

    docs = [document_stall(r, done) for r in done if r.kind == "document"]
    stalled = [d for d in docs if d.stall_s is not None]
    return ServeMetrics(
        num_requests=len(records),
        completed=len(done),
        failed=len(records) - len(done) - not_sent,
        not_sent=not_sent,
        duration_s=duration,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=per_s(len(done)),
        output_throughput=per_s(n_out),
        total_token_throughput=per_s(n_in + n_out),
        ttft_ms=summarize([r.ttft_s for r in done], 1000.0),
        tpot_ms=summarize([t for r in done if (t := r.tpot_s) is not None], 1000.0),
        itl_ms=summarize([g for r in done for g in r.itls_s], 1000.0),
        e2e_ms=summarize([r.e2e_s for r in done], 1000.0),
        ttft_ms_by_kind=by_kind,
        slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms,
        slo_met=met,
        goodput=per_s(met) if met is not None else None,
        stall_ms=summarize([d.stall_s for d in stalled], 1000.0),  # type: ignore[misc]
        tokens_lost=summarize([d.tokens_lost for d in stalled]),
        documents=docs,
        serving_overhead_ms=summarize([x for r in done for x in r.serving_overheads_s], 1000.0),
    )
