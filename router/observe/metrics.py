"""Prometheus metrics of one router, on a private registry (several apps can share a process).

Request latencies are observed by the app as requests finish. Worker figures (queue depth, KV
blocks) and KV-transfer totals belong to the orchestrator: they are read on each scrape
(`await refresh(orch)`) and exported by a custom collector, so a replaced worker's series vanish
instead of freezing at their last value, and the transfer counters are the orchestrator's own
cumulative totals.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from contracts.worker import WorkerStats
from router.observe.timeline import Timeline

log = logging.getLogger("pdserve.metrics")

# Seconds. Buckets follow vLLM's (so dashboards built for it read ours), with finer low ends:
# a CPU tiny model answers in milliseconds, a 70B long prompt queued behind others in tens of seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)  # fmt: skip
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
               240.0, 480.0, 960.0)  # fmt: skip
# Request phases (queue, prefill, decode admission wait, decode) and the stall span E2E's range.
PHASE_BUCKETS = E2E_BUCKETS
# One KV pull: a few blocks over shared memory (tens of us) to a 4k prompt of a 70B model over 100G (~50 ms)
# and a slow rehearsal link (seconds).
TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0, 30.0)  # fmt: skip
# Bytes of one pull, powers of 4 from 4 KiB (a tiny model's block) to 16 GiB (the article's 4k prompt is 671 MB).
TRANSFER_BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(1, 13))
REQUEST_STATUSES = ("ok", "aborted", "error", "rejected")


@dataclass
class _Snapshot:
    workers: list[WorkerStats] = field(default_factory=list)
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    router_queue_depth: int = 0
    dispatch: dict[str, Any] | None = None  # --mode auto: AutoDispatcher.summary()
    pools: dict[str, dict[str, int]] = field(default_factory=dict)  # role -> configured / live workers
    replacements: int = 0
    spans_exported: int = 0  # tracing on: spans the OTLP exporter delivered
    spans_dropped: int = 0  # tracing on: spans lost (bounded queue full, or the collector down)


class _OrchestratorCollector:
    """Exports the last snapshot taken from the orchestrator."""

    def __init__(self, metrics: ServeMetrics):
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        s = self.m.snapshot
        yield from _counters(
            ("pdserve_kv_transfer_bytes", "KV cache bytes moved from prefill to decode workers", s.transfer_bytes),
            ("pdserve_kv_transfer_seconds", "Seconds spent moving KV cache (sum over transfers)", s.transfer_seconds),
        )
        yield GaugeMetricFamily(
            "pdserve_router_queue_depth", "Requests admitted by the router and not finished", value=s.router_queue_depth
        )
        for name, doc in (
            ("configured", "Workers a pool is configured with"),
            ("live", "Workers of a pool alive and serving (below configured while one is replaced)"),
        ):
            g = GaugeMetricFamily(f"pdserve_workers_{name}", doc, labels=["pool"])
            for role, sizes in s.pools.items():
                g.add_metric([role], sizes[name])
            yield g
        yield CounterMetricFamily(
            "pdserve_worker_replacements", "Dead workers replaced since start", value=s.replacements
        )
        per_worker = {
            "pdserve_queue_depth": (
                "Requests waiting on a worker (prefill queue or decode admission)",
                lambda w: w.queue_depth,
            ),
            "pdserve_running_sequences": ("Sequences decoding on a worker", lambda w: w.running),
            "pdserve_kv_blocks_used": ("KV cache blocks in use on a worker", lambda w: w.blocks_used),
            "pdserve_kv_blocks_free": (
                "KV cache blocks an allocation can take on a worker (free or cached)",
                lambda w: w.blocks_free,
            ),
            "pdserve_kv_blocks_total": ("KV cache blocks of a worker's pool", lambda w: w.blocks_total),
            "pdserve_kv_blocks_cached": (
                "Unreferenced KV blocks kept by a worker's prefix cache (evicted LRU)",
                lambda w: w.blocks_cached,
            ),
        }
        for name, (doc, get) in per_worker.items():
            yield _per_worker(GaugeMetricFamily, name, doc, s.workers, get)
        yield from _memory_metrics(s.workers)
        per_worker_totals = {
            "pdserve_preemptions": ("Sequences preempted by recompute on a worker", lambda w: w.preemptions),
            "pdserve_prefix_cache_hit_blocks": (
                "Full KV blocks found in a worker's prefix cache",
                lambda w: w.prefix_hit_blocks,
            ),
            "pdserve_prefix_cache_lookup_blocks": (
                "Full KV blocks looked up in a worker's prefix cache",
                lambda w: w.prefix_lookup_blocks,
            ),
            "pdserve_kv_blocks_evicted": ("Cached KV blocks evicted for new ones", lambda w: w.blocks_evicted),
        }
        for name, (doc, get) in per_worker_totals.items():
            yield _per_worker(CounterMetricFamily, name, doc, s.workers, get)
        yield from _counters(
            ("pdserve_trace_spans_exported", "Spans delivered to the OTLP collector", s.spans_exported),
            (
                "pdserve_trace_spans_dropped",
                "Spans lost on the way to the OTLP collector (export queue full, or the collector down)",
                s.spans_dropped,
            ),
        )
        yield from _dispatch_metrics(s.dispatch or {"decisions": {}, "errors": {}})


def _memory_metrics(workers: list[WorkerStats]) -> Iterator[Metric]:
    """Each worker process's memory: RSS (where the OS reports it), its C heap in use and kept free
    (glibc), and on CUDA the caching allocator's reserved and allocated bytes (only for workers that
    have them)."""
    yield _per_worker(
        GaugeMetricFamily,
        "pdserve_worker_rss_bytes",
        "Resident memory of a worker process",
        [w for w in workers if w.rss_bytes > 0],
        lambda w: w.rss_bytes,
    )
    heap = [w for w in workers if w.heap_in_use_bytes > 0]
    for name, doc, attr in (
        ("in_use", "C heap bytes a worker has malloc'd and not freed (glibc mallinfo2)", "heap_in_use_bytes"),
        ("free", "Freed C heap bytes a worker's malloc arenas keep (fragmentation)", "heap_free_bytes"),
    ):
        yield _per_worker(GaugeMetricFamily, f"pdserve_worker_heap_{name}_bytes", doc, heap, attrgetter(attr))
    cuda = [w for w in workers if w.cuda_reserved_bytes > 0]
    for name, doc, attr in (
        ("reserved", "CUDA memory a worker's torch caching allocator holds from the driver", "cuda_reserved_bytes"),
        ("allocated", "CUDA memory in use by a worker's tensors", "cuda_allocated_bytes"),
    ):
        yield _per_worker(GaugeMetricFamily, f"pdserve_worker_cuda_memory_{name}_bytes", doc, cuda, attrgetter(attr))
    yield _per_worker(
        GaugeMetricFamily,
        "pdserve_worker_compiled_graphs",
        "Decode-step graphs torch.compile built in a worker (--compile; each is also a log line)",
        workers,
        lambda w: w.compiled_graphs,
    )


def _counters(*rows: tuple[str, str, float]) -> Iterator[Metric]:
    """One-sample counters (name, help, value), in the order given."""
    for name, doc, value in rows:
        yield CounterMetricFamily(name, doc, value=value)


def _per_worker(
    family: type[GaugeMetricFamily | CounterMetricFamily],
    name: str,
    doc: str,
    workers: list[WorkerStats],
    get: Callable[[WorkerStats], float],
) -> Metric:
    """One family with a sample per worker, labelled by worker and role: every per-worker figure
    (queue, blocks, memory, totals) is exported the same way, whatever its type."""
    m = family(name, doc, labels=["worker", "role"])
    for w in workers:
        m.add_metric([w.name, w.role], get(w))
    return m


def _dispatch_metrics(d: dict[str, Any]) -> Iterator[Metric]:
    """--mode auto: decisions by kind, and |predicted - realized| / realized histograms. Declared
    (without samples) in the other modes too, so a dashboard's queries resolve against any server."""
    c = CounterMetricFamily("pdserve_dispatch_decisions", "Auto-mode prefill placements", labels=["decision"])
    for k, v in d["decisions"].items():
        c.add_metric([k], v)
    yield c
    h = HistogramMetricFamily(
        "pdserve_dispatch_prediction_abs_rel_error_ratio",
        "Auto mode: |predicted - realized| / realized, per figure (ttft; stall = longest gap beside a local prefill)",
        labels=["figure"],
    )
    for fig, e in d["errors"].items():
        cum, buckets = 0, []
        for bound, n in zip([*map(str, e["buckets"]), "+Inf"], e["counts"]):
            cum += n
            buckets.append((bound, cum))
        h.add_metric([fig], buckets, e["abs_sum"])
    yield h


class ServeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()

        def histogram(name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> Histogram:
            """A histogram on this router's private registry (every one of them is)."""
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.ttft = histogram(
            "pdserve_time_to_first_token_seconds", "Time from request arrival to the first token", TTFT_BUCKETS
        )
        self.tpot = histogram(
            "pdserve_time_per_output_token_seconds",
            "Per request: (last token - first token) / (tokens - 1)",
            TOKEN_BUCKETS,
        )
        self.itl = histogram(
            "pdserve_inter_token_latency_seconds", "Gap between consecutive tokens of a stream", TOKEN_BUCKETS
        )
        self.e2e = histogram(
            "pdserve_e2e_request_latency_seconds", "Time from request arrival to its last token", E2E_BUCKETS
        )
        phase = {
            "queue": ("pdserve_request_queue_time_seconds", "Time a request waited for its prefill to start"),
            "prefill": ("pdserve_request_prefill_time_seconds", "Prefill compute of a request (all its chunks)"),
            "decode_wait": (
                "pdserve_request_decode_admission_wait_seconds",
                "Disaggregated: from prefill end to joining the decode batch, less the KV pull",
            ),
            "decode": ("pdserve_request_decode_time_seconds", "From a request's first token to its last"),
        }
        self.phases = {k: histogram(name, doc, PHASE_BUCKETS) for k, (name, doc) in phase.items()}
        self.transfer_seconds = histogram(
            "pdserve_kv_transfer_duration_seconds",
            "One KV pull from a prefill worker to a decode worker (link = prefill->decode worker)",
            TRANSFER_BUCKETS,
            ("backend", "link"),
        )
        self.transfer_bytes = histogram(
            "pdserve_kv_transfer_size_bytes",
            "Bytes of one KV pull (link = prefill->decode worker)",
            TRANSFER_BYTES_BUCKETS,
            ("backend", "link"),
        )
        self.transfer_exposed = histogram(
            "pdserve_kv_transfer_exposed_seconds",
            "What of a KV transfer was left once its prefill had ended (mode = bulk or layerwise; "
            "layer-wise pulls run during the prefill, so most of theirs is hidden)",
            TRANSFER_BUCKETS,
            ("mode", "link"),
        )
        self.stall = histogram(
            "pdserve_stall_seconds",
            "Per prompt prefilled on a decode worker (colocated, auto local): the longest token gap of the "
            "streams in flight beside it",
            PHASE_BUCKETS,
            ("worker",),
        )
        self.requests = Counter(
            "pdserve_requests", "Requests by outcome (ok, aborted, error, rejected)", ["status"], registry=r
        )
        for s in REQUEST_STATUSES:  # every series exists from the start (rate() needs a zero)
            self.requests.labels(s)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens generated", registry=r)
        self.snapshot = _Snapshot()
        self.span_counts: Callable[[], tuple[int, int]] = lambda: (0, 0)  # set by the app when tracing is on
        r.register(_OrchestratorCollector(self))

    def observe_request(
        self,
        status: str,
        ttft_s: float | None,
        itls_s: list[float],
        e2e_s: float | None,
        completion_tokens: int,
        timeline: Timeline | None = None,
    ) -> None:
        """Called once per admitted request when it ends, whatever the outcome."""
        self.requests.labels(status).inc()
        self.generation_tokens.inc(completion_tokens)
        tl = timeline
        tr = tl.transfer if tl is not None else None
        if tl is not None and tr is not None:  # a pull that happened is counted whatever became of the request
            link = f"{tl.prefill_worker}->{tl.decode_worker}"
            self.transfer_seconds.labels(tr.backend, link).observe(tr.ms / 1e3)
            self.transfer_bytes.labels(tr.backend, link).observe(tr.bytes)
            if tr.exposed_ms is not None:
                self.transfer_exposed.labels(tr.mode, link).observe(tr.exposed_ms / 1e3)
        if tl is not None and tl.local_max_gap_ms is not None:
            self.stall.labels(tl.decode_worker or "").observe(tl.local_max_gap_ms / 1e3)
        if status != "ok":
            return  # latencies of aborted/failed requests would pollute the distributions
        if tl is not None:
            for key, ms in (("queue", tl.queue_ms), ("prefill", tl.prefill_ms), ("decode_wait", tl.decode_wait_ms)):
                if ms is not None:
                    self.phases[key].observe(max(0.0, ms) / 1e3)
            if tl.first_token_ms is not None and tl.last_token_ms is not None:
                self.phases["decode"].observe(max(0.0, tl.last_token_ms - tl.first_token_ms) / 1e3)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        for gap in itls_s:
            self.itl.observe(gap)
        if completion_tokens > 1 and ttft_s is not None and e2e_s is not None:
            self.tpot.observe((e2e_s - ttft_s) / (completion_tokens - 1))
        if e2e_s is not None:
            self.e2e.observe(e2e_s)

    async def refresh(self, orch: Any, timeout_s: float = 5.0) -> None:
        """Take a new snapshot; if the workers do not answer in time, keep the figures we can get."""
        snap = _Snapshot()
        snap.transfer_bytes, snap.transfer_seconds = orch.transfer_totals()
        snap.router_queue_depth = orch.queue_depth()
        summary = getattr(orch, "dispatch_summary", None)  # fakes in tests may lack it
        snap.dispatch = summary() if summary is not None else None
        try:
            snap.workers = list(await asyncio.wait_for(orch.stats(), timeout_s))
        except Exception as e:  # noqa: BLE001 - a scrape must answer even when a worker does not
            log.warning("worker stats unavailable for /metrics: %r", e)
        snap.pools = orch.pool_status()  # after stats(): a death it noticed shows already
        snap.replacements = getattr(orch, "replacements", 0)
        snap.spans_exported, snap.spans_dropped = self.span_counts()
        self.snapshot = snap

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
