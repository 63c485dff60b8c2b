"""A finished request's timeline as trace phases: consecutive intervals that cover the request.

Pure data, no OpenTelemetry: router/observe/tracing.py turns these into spans. The phases partition
[HTTP arrival, response end] exactly, so their durations add up to the request's end-to-end time
(a trace viewer's waterfall has no holes and no overlaps). Each phase ends at a stamp of the
timeline; a phase whose stamp is missing (a request that failed early, one whose first token was
its last, colocated mode with no KV transfer) is left out and its time goes to the next phase.
Stamps from the workers' clocks are clamped into order, so a skewed clock shortens a phase to 0
instead of producing a negative one.

Disaggregated: validate, dispatch, queue, prefill, decode_admission, kv_transfer, decode, finish.
Layer-wise KV transfer: validate, dispatch, queue, prefill, kv_transfer_exposed (the prefill's end to
the last pull's end: what of the transfer the prefill did not hide), decode_admission (the last
pull's end to the decode worker's admission), decode, finish.
Colocated (and auto's local prompts): validate, dispatch, queue, prefill, decode, finish.

Layer-wise, the stamps the workers sent back add spans below the phases (a bulk trace has none):
the prefill phase's children, one `prefill.layers a-b` per group of layers the prefill worker
wrote and announced (from the previous announcement, or the prefill's start, to its own), then
`prefill.lm_head` (the last announcement to the prefill's end); they tile the prefill. And beside
the phases, children of the request's own span, one `kv_transfer.layers a-b` per pull on the decode
worker: the pulls overlap the prefill in time (that is the point of streaming the layers), so they
are clamped into the request, not into a phase.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.observe.timeline import KVTransfer, Timeline
from transport.wire import LINKS_GBPS

AttrValue = str | int | float | bool


@dataclass
class Phase:
    name: str
    start_ns: int  # unix time
    end_ns: int
    attributes: dict[str, AttrValue] = field(default_factory=dict)
    children: list[Phase] = field(default_factory=list)  # spans inside this one, in order

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass
class RequestTrace:
    """What one request's trace shows: its phases, the stream to the client (overlapping the
    phases: first token to end), and events (first token, preemptions, the error). Layer-wise, the
    prefill phase's children are its groups of layers, and `overlapping` holds the KV pulls: more
    children of the request's span, beside the phases, overlapping the prefill."""

    phases: list[Phase]
    stream: Phase | None
    events: list[tuple[str, int, dict[str, AttrValue]]]  # (name, unix ns, attributes)
    error: str | None  # set when the request failed or was aborted
    root: dict[str, AttrValue] = field(default_factory=dict)  # the request's own span: its tokens, mode, ending
    overlapping: list[Phase] = field(default_factory=list)  # layer-wise: one span per KV pull, in order


def _ms_to_ns(tl: Timeline, ms: float | None) -> int | None:
    return None if ms is None else _at(tl, ms)


def _at(tl: Timeline, ms: float) -> int:
    """Stamp `ms` (ms after arrival) as unix ns."""
    return int(round((tl.arrival + ms / 1e3) * 1e9))


def _flat(prefix: str, d: dict[str, Any]) -> dict[str, AttrValue]:
    out: dict[str, AttrValue] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(f"{prefix}{k}.", v))
        elif isinstance(v, str | int | float | bool):
            out[f"{prefix}{k}"] = v
    return out


def _or(v: Any, default: Any) -> Any:
    """A stamp, or what a span shows when it was not taken."""
    return default if v is None else v


def _layers(first: int, end: int) -> str:
    """Layers [first, end) as a span name shows them: "4-7", or "4" alone."""
    return f"{first}-{end - 1}" if end - 1 > first else str(first)


def _chunks(groups: list[tuple[int, int]]) -> list[int]:
    """Each group's prefill chunk: a chunk announces its groups from the first layer up, so a group
    that starts at or below the previous one starts the next chunk (counting the chunks that
    announced something: one that completed no new KV block announces nothing)."""
    out, chunk, prev = [], 0, None
    for first, _ in groups:
        if prev is not None and first <= prev:
            chunk += 1
        out.append(chunk)
        prev = first
    return out


def _transfer_end_ms(tl: Timeline, tr: KVTransfer) -> float | None:
    """A layer-wise transfer's end: its last pull's, or the prefill's end plus what was exposed."""
    if tr.group_spans:
        return max(end for _, _, _, end, _ in tr.group_spans)
    if tl.prefill_end_ms is not None and tr.exposed_ms is not None:
        return tl.prefill_end_ms + tr.exposed_ms
    return None


def _prefill_groups(tl: Timeline, prefill: Phase) -> list[Phase]:
    """The prefill phase's children: each announced group of layers, then the rest of the prefill."""
    t, out = prefill.start_ns, []
    worker = str(tl.prefill_worker)
    groups = tl.prefill_groups
    for (first, end, ms), chunk in zip(groups, _chunks([(a, b) for a, b, _ in groups]), strict=True):
        at = min(max(_at(tl, ms), t), prefill.end_ns)
        attrs: dict[str, AttrValue] = {
            "pdserve.worker": worker,
            "pdserve.first_layer": first,
            "pdserve.last_layer": end - 1,
            "pdserve.chunk": chunk,
        }
        out.append(Phase(f"prefill.layers {_layers(first, end)}", t, at, attrs))
        t = at
    out.append(Phase("prefill.lm_head", t, prefill.end_ns, {"pdserve.worker": worker}))
    return out


def _pulls(tl: Timeline, tr: KVTransfer, t0: int, t1: int) -> list[Phase]:
    """One span per layer-wise pull, on the decode worker's clock, clamped into [t0, t1]."""
    out = []
    spans = tr.group_spans
    for (first, end, start_ms, end_ms, nbytes), chunk in zip(
        spans, _chunks([(a, b) for a, b, *_ in spans]), strict=True
    ):
        start = min(max(_at(tl, start_ms), t0), t1)
        stop = min(max(_at(tl, end_ms), start), t1)
        attrs: dict[str, AttrValue] = {
            "pdserve.first_layer": first,
            "pdserve.last_layer": end - 1,
            "pdserve.chunk": chunk,
            "pdserve.kv.mode": tr.mode,
            "pdserve.kv.backend": tr.backend,
            "pdserve.kv.bytes": nbytes,
            "pdserve.kv.ms": round(end_ms - start_ms, 3),
            "pdserve.kv.src": str(tl.prefill_worker),
            "pdserve.kv.dst": str(tl.decode_worker),
            **{f"pdserve.kv.link_ms.{k}": round(nbytes / (g * 1e9) * 1e3, 4) for k, g in LINKS_GBPS.items()},
        }
        if tr.link_gbits_per_s:  # a nominal --link-gbps: that link, and this pull's time on it
            attrs["pdserve.kv.link_gbits_per_s"] = tr.link_gbits_per_s
            attrs["pdserve.kv.link_nominal_ms"] = round(nbytes * 8 / (tr.link_gbits_per_s * 1e9) * 1e3, 4)
        out.append(Phase(f"kv_transfer.layers {_layers(first, end)}", start, stop, attrs))
    return out


def build(
    timeline: Timeline | Mapping[str, Any],
    http_arrival_ns: int,
    end_ns: int,
    status: str,
    error: str | None,
    chunk_size: int | None,
) -> RequestTrace:
    """The trace of a request whose timeline is `timeline` (router/observe/timeline.py; its JSON works too),
    received at `http_arrival_ns` and closed at `end_ns`."""
    tl = timeline if isinstance(timeline, Timeline) else Timeline.from_dict(timeline)
    prompt, cached, out_tokens = tl.prompt_tokens, _or(tl.prefill_cached_tokens, 0), tl.output_tokens
    tr = tl.transfer
    layerwise = tr is not None and tr.mode == "layerwise"
    admitted = _ms_to_ns(tl, tl.decode_admitted_ms)
    first = _ms_to_ns(tl, tl.first_token_ms)
    disagg = tl.prefill_worker is not None
    if disagg:
        prefill_start, prefill_end = _ms_to_ns(tl, tl.prefill_start_ms), _ms_to_ns(tl, tl.prefill_end_ms)
    else:  # the decode worker prefilled: its first token ends the prefill
        prefill_end = first
        prefill_start = None if first is None or tl.prefill_ms is None else first - int(tl.prefill_ms * 1e6)
    transfer_start = None if admitted is None or tr is None else admitted - int(tr.ms * 1e6)
    dispatch: dict[str, AttrValue] = {
        "pdserve.policy": _or(tl.policy, ""),
        "pdserve.reason": _or(tl.dispatch_reason, ""),
        "pdserve.decode_worker": _or(tl.decode_worker, ""),
        "pdserve.prefill_worker": tl.prefill_worker or "",
    }
    if tl.dispatch is not None:  # auto: the decision, its reason and both predictions
        dispatch.update(_flat("pdserve.auto.", tl.dispatch))
    for k, v in (tl.routed_prefix_blocks or {}).items():
        dispatch[f"pdserve.routed_prefix_blocks.{k}"] = int(v)
    n_chunks = max(1, -(-(prompt - cached) // chunk_size)) if chunk_size else 1
    worker_prefill = tl.prefill_worker or _or(tl.decode_worker, "")
    steps: list[tuple[str, int | None, dict[str, AttrValue]]] = [
        ("validate", int(tl.arrival * 1e9), {"pdserve.prompt_tokens": prompt}),
        ("dispatch", _ms_to_ns(tl, tl.dispatched_ms), dispatch),
        (
            "queue",
            prefill_start,
            {"pdserve.worker": worker_prefill, "pdserve.worker_queue_ms": _or(tl.queue_ms, 0.0)},
        ),
        (
            "prefill",
            prefill_end,
            {
                "pdserve.worker": worker_prefill,
                "pdserve.prompt_tokens": prompt,
                "pdserve.cached_tokens": cached,
                "pdserve.computed_tokens": prompt - cached,
                "pdserve.chunks": n_chunks,
                "pdserve.prefill_ms": _or(tl.prefill_ms, 0.0),
                "pdserve.kv_blocks": _or(tl.kv_blocks, 0),
            },
        ),
    ]
    if disagg:
        admission: dict[str, AttrValue] = {"pdserve.worker": str(tl.decode_worker)}
        kv: dict[str, AttrValue] = {}
        if tr is not None:
            link = {f"pdserve.kv.link_ms.{k}": float(v) for k, v in tr.link_ms.items()}
            nominal = {  # with a nominal --link-gbps only
                "link_gbits_per_s": tr.link_gbits_per_s,
                "link_nominal_ms": tr.link_nominal_ms,
                "rate_vs_link": tr.rate_vs_link,
            }
            kv = {
                "pdserve.kv.backend": tr.backend,
                "pdserve.kv.bytes": tr.bytes,
                "pdserve.kv.descriptors": tr.descriptors,
                "pdserve.kv.gbytes_per_s": tr.gbytes_per_s,
                "pdserve.kv.blocks_pulled": _or(tl.kv_blocks_pulled, 0),
                "pdserve.kv.decode_cached_tokens": _or(tl.decode_cached_tokens, 0),
                "pdserve.kv.src": str(tl.prefill_worker),
                "pdserve.kv.dst": str(tl.decode_worker),
                **link,
                **{f"pdserve.kv.{k}": v for k, v in nominal.items() if v is not None},
            }
        if tr is not None and layerwise:  # the pulls ran during the prefill: what was left after it
            placed = {"overlap_ms": tr.overlap_ms, "exposed_ms": tr.exposed_ms}
            kv.update({"pdserve.kv.mode": tr.mode, "pdserve.kv.groups": tr.groups, "pdserve.kv.ms": tr.ms})
            kv.update({f"pdserve.kv.{k}": v for k, v in placed.items() if v is not None})
            steps.append(("kv_transfer_exposed", _ms_to_ns(tl, _transfer_end_ms(tl, tr)), kv))
            steps.append(("decode_admission", admitted, admission))
        else:
            steps.append(("decode_admission", transfer_start or admitted, admission))
            if tr is not None and transfer_start is not None:
                steps.append(("kv_transfer", admitted, kv))
    steps.append(
        (
            "decode",
            _ms_to_ns(tl, tl.last_token_ms),
            {
                "pdserve.worker": _or(tl.decode_worker, ""),
                "pdserve.output_tokens": out_tokens,
                "pdserve.decode_steps": max(0, out_tokens - 1),  # one token per step after the first
                "pdserve.preemptions": tl.preemptions,
            },
        )
    )
    steps.append(("finish", end_ns, {"pdserve.finish_reason": _or(tl.finish_reason, status)}))

    phases: list[Phase] = []
    t = http_arrival_ns
    for name, stamp, attrs in steps:
        if stamp is None:
            continue
        stamp = min(max(stamp, t), end_ns)
        phases.append(Phase(name, t, stamp, attrs))
        t = stamp
    for i, p in enumerate(phases):
        p.attributes["pdserve.phase"] = i
        if p.name == "prefill" and disagg and tl.prefill_groups:
            p.children = _prefill_groups(tl, p)
    pulls = _pulls(tl, tr, http_arrival_ns, end_ns) if tr is not None and tr.group_spans else []
    events: list[tuple[str, int, dict[str, AttrValue]]] = []
    stream = None
    if first is not None:
        first = min(max(first, http_arrival_ns), end_ns)
        events.append(("first_token", first, {"pdserve.ttft_ms": (first - http_arrival_ns) / 1e6}))
        stream = Phase("stream", first, end_ns, {"pdserve.output_tokens": out_tokens, "pdserve.status": status})
    if tl.preemptions:
        events.append(("preempted", end_ns, {"pdserve.preemptions": tl.preemptions}))
    if status != "ok" and error is None:
        error = "the client went away" if status == "aborted" else f"the request ended with {status}"
    root: dict[str, AttrValue] = {
        "gen_ai.usage.input_tokens": prompt,
        "gen_ai.usage.output_tokens": out_tokens,
        "pdserve.request_id": tl.request_id,
        "pdserve.mode": tl.mode,
        "pdserve.finish_reason": _or(tl.finish_reason, ""),
    }
    return RequestTrace(phases, stream, events, error if status != "ok" else None, root, pulls)
