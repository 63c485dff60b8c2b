"""`pdserve bench layerwise`'s figures from its requests: the cost model's prediction of each one's
exposed transfer (with the link calibrated on the warm-up), the medians and ratios per mode, and the table.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from benchmarks.transfer.layerwise_shot import Shot
from costmodel.article.layerwise import LinkSpec, bulk_exposed_s, layerwise_exposed_s

EXPOSED_FLOOR_MS = 1.0  # below this an exposed transfer is timing noise (client and server clocks)


def predict(shots: list[Shot], link: LinkSpec, bulk_start_s: float = 0.0) -> None:
    """Each shot's exposed transfer by the cost model, from its own measured prefill and bytes.
    `bulk_start_s`: a bulk pull starts that long after the prefill's end (the first token's trip
    through the router and the decode worker's admission call; a layer-wise pull has none)."""
    for s in shots:
        if s.error is not None:
            continue
        if s.used == "bulk":
            s.predicted_exposed_ms = (bulk_start_s + bulk_exposed_s(s.kv_bytes, link)) * 1e3
        else:
            groups, tail = max(1, s.groups), (s.tail_ms or 0.0) / 1e3
            exposed = layerwise_exposed_s(s.kv_bytes, s.prefill_ms / 1e3, groups, link, tail_s=tail)
            s.predicted_exposed_ms = exposed * 1e3


def calibrated_link(warm: list[Shot], default_per_pull_s: float, burst: float) -> tuple[LinkSpec, float, str] | None:
    """The link as the last warm-up document measured it (never a measured document: the
    predictions are not replayed): its bulk pull's rate, and the per-pull cost its layer-wise
    pulls took beyond that pull's time (the default when it was not streamed). The first document
    is no calibration: its pull opens the UCX connection (seconds over TCP)."""
    last = max((s.doc for s in warm), default=-1)
    bulk = next((s for s in warm if s.doc == last and s.used == "bulk" and not s.error and s.transfer_ms > 0), None)
    if bulk is None:
        return None
    rate = max(1.0, bulk.kv_bytes - burst) / (bulk.transfer_ms / 1e3)  # the burst went at line rate
    lw = next((s for s in warm if s.doc == last and s.used == "layerwise" and not s.error and s.groups > 1), None)
    per_pull = default_per_pull_s
    if lw is not None and lw.transfer_ms > bulk.transfer_ms:
        per_pull = (lw.transfer_ms - bulk.transfer_ms) / 1e3 / (lw.groups - 1)
    tr, end = bulk.timeline.get("transfer") or {}, bulk.timeline.get("prefill_end_ms")
    start = max(0.0, (tr["start_ms"] - end) / 1e3) if tr.get("start_ms") is not None and end is not None else 0.0
    note = (
        f"{rate * 8 / 1e9:.2f} Gbit/s, {per_pull * 1e3:.2f} ms a pull, a bulk pull starting {start * 1e3:.1f} ms "
        f"after the prefill: calibrated on warm-up document {last + 1}"
    )
    return LinkSpec(rate, per_pull, burst), start, note


def _pairs(shots: list[Shot], other: str) -> list[tuple[Shot, Shot]]:
    """(bulk, other) shots of the same document, both without error."""
    by: dict[int, dict[str, Shot]] = {}
    for s in shots:
        if s.error is None:
            by.setdefault(s.doc, {})[s.mode] = s
    return [(d["bulk"], d[other]) for d in by.values() if "bulk" in d and other in d]


def summarize(shots: list[Shot], modes: tuple[str, str]) -> dict[str, Any]:
    """Medians per mode and the ratios of the second mode to bulk (all from this one run)."""
    out: dict[str, Any] = {}
    for mode in modes:
        ok = [s for s in shots if s.mode == mode and s.error is None]
        if not ok:
            continue

        def med(key: str, rows: list[Shot] = ok) -> float | None:
            vals = [getattr(s, key) for s in rows if getattr(s, key) is not None]
            return round(statistics.median(vals), 3) if vals else None

        out[mode] = {
            k: med(k)
            for k in (
                "ttft_ms",
                "gap12_ms",
                "step_ms",
                "exposed_ms",
                "exposed_vs_later_steps_ms",
                "first_step_ms",
                "handoff_ms",
                "timeline_exposed_ms",
                "predicted_exposed_ms",
                "overlap_ms",
                "transfer_ms",
                "prefill_ms",
                "kv_bytes",
                "prompt_tokens",
                "groups",
                "tail_ms",
                "open_ms",
            )
        }
        out[mode]["requests"] = len(ok)
    other = modes[1]
    if "bulk" in out and other in out:
        b, lw = out["bulk"], out[other]
        # a hidden transfer's exposed part is ~0 (either sign: two clocks); the ratio takes 1 ms for less
        out["exposed_floor_ms"] = EXPOSED_FLOOR_MS
        out[f"exposed_bulk_over_{other}"] = round(b["exposed_ms"] / max(lw["exposed_ms"], EXPOSED_FLOOR_MS), 2)
        if b["handoff_ms"] and lw["handoff_ms"] and lw["handoff_ms"] > 0:
            out[f"handoff_bulk_over_{other}"] = round(b["handoff_ms"] / lw["handoff_ms"], 2)
        out[f"ttft_{other}_over_bulk"] = round(lw["ttft_ms"] / b["ttft_ms"], 3)
        out[f"second_token_{other}_over_bulk"] = round(
            (lw["ttft_ms"] + lw["gap12_ms"]) / (b["ttft_ms"] + b["gap12_ms"]), 3
        )
        # the same document in both modes, a minute apart: prefill times drift by 10-20% across
        # documents and minutes on a shared VM, less within a pair
        pairs = _pairs(shots, other)
        if pairs:
            out[f"ttft_{other}_over_bulk_paired"] = round(statistics.median(o.ttft_ms / b.ttft_ms for b, o in pairs), 3)
            out[f"second_token_{other}_over_bulk_paired"] = round(
                statistics.median((o.ttft_ms + o.gap12_ms) / (b.ttft_ms + b.gap12_ms) for b, o in pairs), 3
            )
        # the fixed cost of one layer-wise pull: what the groups' pulls took beyond one bulk pull
        # of the same bytes, per pull (the cost model's per-group overhead)
        if lw["groups"] and lw["groups"] > 1 and lw["transfer_ms"] and b["transfer_ms"]:
            out["per_pull_overhead_ms"] = round((lw["transfer_ms"] - b["transfer_ms"]) / (lw["groups"] - 1), 3)
        for mode in modes:
            m = out[mode]
            if m["predicted_exposed_ms"] and m["exposed_ms"]:
                m["prediction_error"] = round(m["predicted_exposed_ms"] / m["exposed_ms"] - 1, 3)
            if m["predicted_exposed_ms"] and m["timeline_exposed_ms"]:
                m["prediction_error_vs_timeline"] = round(m["predicted_exposed_ms"] / m["timeline_exposed_ms"] - 1, 3)
            if m["predicted_exposed_ms"] is not None and m["timeline_exposed_ms"] is not None:
                # near 0 ms (a hidden transfer) a ratio means nothing: the difference does
                m["prediction_minus_timeline_ms"] = round(m["predicted_exposed_ms"] - m["timeline_exposed_ms"], 3)
        same = [
            a.token_ids == b2.token_ids
            for a in shots
            for b2 in shots
            if a.doc == b2.doc and a.mode == "bulk" and b2.mode == other and not a.error and not b2.error
        ]
        out["greedy_tokens_equal"] = bool(same) and all(same)
    return out


def print_table(shots: list[Shot], summary: dict[str, Any], link_note: str, modes: tuple[str, str]) -> None:
    from benchmarks.engine.cli import table  # noqa: PLC0415 - torch, only to print

    rows = []
    for mode in modes:
        m = summary.get(mode)
        if not m:
            continue
        rows.append(
            [
                mode,
                str(m["requests"]),
                f"{m['ttft_ms']:.1f}",
                f"{m['gap12_ms']:.1f}",
                f"{m['step_ms']:.1f}",
                f"{m['exposed_ms']:.1f}",
                f"{m['handoff_ms']:.1f}" if m["handoff_ms"] is not None else "-",
                f"{m['timeline_exposed_ms']:.1f}" if m["timeline_exposed_ms"] is not None else "-",
                f"{m['predicted_exposed_ms']:.1f}" if m["predicted_exposed_ms"] is not None else "-",
                f"{m['overlap_ms']:.1f}" if m["overlap_ms"] is not None else "-",
                f"{m['kv_bytes'] / 1e6:.2f}",
            ]
        )
    heads = [
        "mode",
        "n",
        "TTFT",
        "1st->2nd",
        "step",
        "exposed",
        "hand-off",
        "tl exposed",
        "predicted",
        "overlap",
        "KV MB",
    ]
    print(table(heads, rows))
    print(
        f"median ms per request; exposed = 1st->2nd gap (client) - the request's first decode step (server); "
        f"step = median later gap (client); hand-off = prefill end -> decode "
        f"admission (servers); tl exposed = last pull end - prefill end (timeline); predicted = cost model "
        f"(costmodel/article/layerwise.py) at {link_note}"
    )
    other = modes[1]
    if f"ttft_{other}_over_bulk" in summary:
        ttft, ttft_paired = summary[f"ttft_{other}_over_bulk"], summary.get(f"ttft_{other}_over_bulk_paired")
        second = summary[f"second_token_{other}_over_bulk"]
        second_paired = summary.get(f"second_token_{other}_over_bulk_paired")
        print(
            f"exposed transfer bulk/{other}: {summary[f'exposed_bulk_over_{other}']}x; TTFT {other}/bulk: {ttft} "
            f"(paired by document: {ttft_paired}); second token {other}/bulk: {second} (paired: {second_paired}); "
            f"greedy tokens equal: {summary['greedy_tokens_equal']}"
        )
    errors = [s for s in shots if s.error]
    for s in errors[:5]:
        print(f"doc {s.doc} {s.mode}: {s.error}", file=sys.stderr)
