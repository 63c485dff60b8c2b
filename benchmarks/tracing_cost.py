"""What request tracing costs the router, per request, measured on its own:

- on the event loop: opening the root span and, when the request ends, writing its ~10 spans from
  the timeline (router/observe/tracing.py), with an exporter that does nothing;
- on the export thread: encoding those spans to OTLP protobuf (what the BatchSpanProcessor's
  thread does before its POST; the POST itself waits on the network, not the CPU).

Both hold the GIL, so both can delay a token on its way out; the decode step is untouched (the
workers do no tracing work). `python -m benchmarks.tracing_cost [--requests N] [--out NAME]`.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from costmodel.provenance import write_result
from router.observe.tracing import Tracing


class _Keep(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def timeline(arrival: float) -> dict[str, Any]:
    """A disaggregated request's timeline as router/lifecycle/orchestrator.py writes it (48 tokens)."""
    return {
        "request_id": "cmpl-bench", "mode": "disagg", "arrival": arrival, "prompt_tokens": 64, "output_tokens": 48,
        "prefill_worker": "prefill-0", "decode_worker": "decode-0", "policy": "round_robin",
        "dispatch_reason": "prefill prefill-0: round_robin: next in turn; decode decode-0: round_robin: next in turn",
        "dispatched_ms": 0.4, "queue_ms": 1.0, "prefill_start_ms": 2.0, "prefill_ms": 8.0, "prefill_end_ms": 10.0,
        "kv_blocks": 4, "prefill_cached_tokens": 0, "first_token_ms": 11.0, "decode_admitted_ms": 15.0,
        "decode_cached_tokens": 0, "kv_blocks_pulled": 4,
        "transfer": {"backend": "nixl", "bytes": 65536, "descriptors": 1, "ms": 2.0, "gbytes_per_s": 0.033,
                     "link_ms": {"nvlink": 0.0001, "ib-400g": 0.0013, "ib-100g": 0.0052}, "gbits_per_s": 0.262},
        "last_token_ms": 700.0, "finish_reason": "length",
    }  # fmt: skip


def measure(n: int) -> dict[str, float]:
    keep = _Keep()
    tr = Tracing("http://127.0.0.1:9", exporter=keep)  # the endpoint is never reached: `keep` replaces OTLP
    t = time.time_ns()
    tl = timeline(t / 1e9)
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}

    def requests(k: int) -> float:
        t0 = time.perf_counter()
        for i in range(k):
            root = tr.start(headers, "POST /v1/completions", t, {"pdserve.request_id": f"r{i}"})
            tr.finish(root, tl, t, t + 710_000_000, "ok", None)
        return (time.perf_counter() - t0) / k

    requests(50)  # warm
    loop_s = min(requests(n) for _ in range(3))
    tr.provider.force_flush()
    spans = keep.spans[-10 * 52 :]  # one export batch's worth (the processor's default is 512)
    t0 = time.perf_counter()
    for _ in range(10):
        encode_spans(spans).SerializeToString()
    encode_s = (time.perf_counter() - t0) / 10
    per_request = len(spans) / 52
    tr.shutdown()
    return {
        "spans_per_request": per_request,
        "event_loop_us_per_request": loop_s * 1e6,
        "export_encode_us_per_request": encode_s / 52 * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--out", default=None, help="write NAME.json (to benchmarks/results/local/ unless --out-dir)")
    p.add_argument("--out-dir", default=None, metavar="DIR")
    args = p.parse_args(argv)
    load_before = os.getloadavg()[0]  # other jobs on the machine inflate both figures
    r = measure(args.requests)
    r.update(load_avg_1min_before=load_before, load_avg_1min_after=os.getloadavg()[0])
    print(
        f"tracing cost per request ({r['spans_per_request']:.0f} spans): event loop "
        f"{r['event_loop_us_per_request']:.0f} us, export thread (encode) {r['export_encode_us_per_request']:.0f} us"
    )
    if args.out:
        out_dir = Path(args.out_dir) if args.out_dir else None
        print("results:", write_result(args.out, {"result": r}, {"requests": args.requests}, out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
