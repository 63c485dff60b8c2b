"""A finished request's timeline as trace phases: consecutive intervals that cover the request.

Pure data, no OpenTelemetry: router/tracing.py turns these into spans. The phases partition
[HTTP arrival, response end] exactly, so their durations add up to the request's end-to-end time
(a trace viewer's waterfall has no holes and no overlaps). Each phase ends at a stamp of the
timeline; a phase whose stamp is missing (a request that failed early, one whose first token was
its last, colocated mode with no KV transfer) is left out and its time goes to the next phase.
Stamps from the workers' clocks are clamped into order, so a skewed clock shortens a phase to 0
instead of producing a negative one.

Disaggregated: validate, dispatch, queue, prefill, decode_admission, kv_transfer, decode, finish.
Colocated (and auto's local prompts): validate, dispatch, queue, prefill, decode, finish.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

AttrValue = str | int | float | bool


@dataclass
class Phase:
    name: str
    start_ns: int  # unix time
    end_ns: int
    attributes: dict[str, AttrValue] = field(default_factory=dict)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass
class RequestTrace:
    """What one request's trace shows: its phases, the stream to the client (overlapping the
    phases: first token to end), and events (first token, preemptions, the error)."""

    phases: list[Phase]
    stream: Phase | None
    events: list[tuple[str, int, dict[str, AttrValue]]]  # (name, unix ns, attributes)
    error: str | None  # set when the request failed or was aborted


def _ms_to_ns(tl: dict[str, Any], key: str) -> int | None:
    v = tl.get(key)
    return None if v is None else int(round((tl["arrival"] + v / 1e3) * 1e9))


def _flat(prefix: str, d: dict[str, Any]) -> dict[str, AttrValue]:
    out: dict[str, AttrValue] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(f"{prefix}{k}.", v))
        elif isinstance(v, str | int | float | bool):
            out[f"{prefix}{k}"] = v
    return out


def build(
    tl: dict[str, Any], http_arrival_ns: int, end_ns: int, status: str, error: str | None, chunk_size: int | None
) -> RequestTrace:
    """The trace of a request whose timeline is `tl` (router/orchestrator.py's stamps: unix
    `arrival`, the rest in ms after it), received at `http_arrival_ns` and closed at `end_ns`."""
    prompt, cached = int(tl.get("prompt_tokens", 0)), int(tl.get("prefill_cached_tokens", tl.get("cached_tokens", 0)))
    out_tokens = int(tl.get("output_tokens", 0))
    tr = tl.get("transfer") or {}
    admitted = _ms_to_ns(tl, "decode_admitted_ms")
    first = _ms_to_ns(tl, "first_token_ms")
    disagg = tl.get("prefill_worker") is not None
    if disagg:
        prefill_start, prefill_end = _ms_to_ns(tl, "prefill_start_ms"), _ms_to_ns(tl, "prefill_end_ms")
    else:  # the decode worker prefilled: its first token ends the prefill
        prefill_end = first
        prefill_start = None if first is None or "prefill_ms" not in tl else first - int(tl["prefill_ms"] * 1e6)
    transfer_start = None if admitted is None or "ms" not in tr else admitted - int(tr["ms"] * 1e6)
    dispatch: dict[str, AttrValue] = {
        "pdserve.policy": str(tl.get("policy", "")),
        "pdserve.reason": str(tl.get("dispatch_reason", "")),
        "pdserve.decode_worker": str(tl.get("decode_worker", "")),
        "pdserve.prefill_worker": str(tl.get("prefill_worker") or ""),
    }
    if "dispatch" in tl:  # auto: the decision, its reason and both predictions
        dispatch.update(_flat("pdserve.auto.", tl["dispatch"]))
    for k, v in (tl.get("routed_prefix_blocks") or {}).items():
        dispatch[f"pdserve.routed_prefix_blocks.{k}"] = int(v)
    n_chunks = max(1, -(-(prompt - cached) // chunk_size)) if chunk_size else 1
    worker_prefill = str(tl.get("prefill_worker") or tl.get("decode_worker", ""))
    steps: list[tuple[str, int | None, dict[str, AttrValue]]] = [
        ("validate", int(tl["arrival"] * 1e9), {"pdserve.prompt_tokens": prompt}),
        ("dispatch", _ms_to_ns(tl, "dispatched_ms"), dispatch),
        (
            "queue",
            prefill_start,
            {"pdserve.worker": worker_prefill, "pdserve.worker_queue_ms": tl.get("queue_ms", 0.0)},
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
                "pdserve.prefill_ms": tl.get("prefill_ms", 0.0),
                "pdserve.kv_blocks": int(tl.get("kv_blocks", 0)),
            },
        ),
    ]
    if disagg:
        steps.append(("decode_admission", transfer_start or admitted, {"pdserve.worker": str(tl.get("decode_worker"))}))
        if transfer_start is not None:
            link = {f"pdserve.kv.link_ms.{k}": float(v) for k, v in (tr.get("link_ms") or {}).items()}
            steps.append(
                (
                    "kv_transfer",
                    admitted,
                    {
                        "pdserve.kv.backend": str(tr.get("backend", "")),
                        "pdserve.kv.bytes": int(tr.get("bytes", 0)),
                        "pdserve.kv.descriptors": int(tr.get("descriptors", 0)),
                        "pdserve.kv.gbytes_per_s": float(tr.get("gbytes_per_s", 0.0)),
                        "pdserve.kv.blocks_pulled": int(tl.get("kv_blocks_pulled", 0)),
                        "pdserve.kv.decode_cached_tokens": int(tl.get("decode_cached_tokens", 0)),
                        "pdserve.kv.src": str(tl.get("prefill_worker")),
                        "pdserve.kv.dst": str(tl.get("decode_worker")),
                        **link,
                        **{
                            f"pdserve.kv.{k}": v
                            for k, v in tr.items()
                            if k.startswith(("link_gbits", "link_nominal", "rate_vs")) and isinstance(v, int | float)
                        },
                    },
                )
            )
    steps.append(
        (
            "decode",
            _ms_to_ns(tl, "last_token_ms"),
            {
                "pdserve.worker": str(tl.get("decode_worker", "")),
                "pdserve.output_tokens": out_tokens,
                "pdserve.decode_steps": max(0, out_tokens - 1),  # one token per step after the first
                "pdserve.preemptions": int(tl.get("preemptions", 0)),
            },
        )
    )
    steps.append(("finish", end_ns, {"pdserve.finish_reason": str(tl.get("finish_reason", status))}))

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
    events: list[tuple[str, int, dict[str, AttrValue]]] = []
    stream = None
    if first is not None:
        first = min(max(first, http_arrival_ns), end_ns)
        events.append(("first_token", first, {"pdserve.ttft_ms": (first - http_arrival_ns) / 1e6}))
        stream = Phase("stream", first, end_ns, {"pdserve.output_tokens": out_tokens, "pdserve.status": status})
    if tl.get("preemptions"):
        events.append(("preempted", end_ns, {"pdserve.preemptions": int(tl["preemptions"])}))
    if status != "ok" and error is None:
        error = "the client went away" if status == "aborted" else f"the request ended with {status}"
    return RequestTrace(phases, stream, events, error if status != "ok" else None)
