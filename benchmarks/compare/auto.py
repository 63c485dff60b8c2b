"""`bench compare`'s per-request accuracy and the `--modes ...,auto` report.

For every mode: each request's predicted (simulator, calibrated step-cost fit) vs measured TTFT,
p50 ITL and longest gap (its stall), with the relative error. For auto: how often each placement
was chosen, the router's own TTFT predictions against the realized TTFT (router-side, and as the
client saw it), TTFT by prompt-length bucket, and a plot of the decisions over prompt length x
streams in flight against the boundary the calibrated cost model draws.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

WITHIN = 0.15
BUCKETS = (64, 256, 1024, 4096, 1 << 30)  # prompt-length upper bounds


def _err(p: float | None, m: float | None) -> float | None:
    return None if p is None or not m else (p - m) / m


def _record_figures(r: Any) -> dict[str, float | None]:
    """TTFT, p50 ITL and longest gap of one client record, ms (None when it never streamed)."""
    t = r.chunk_times_s
    if not t or r.send_s is None:
        return {"ttft_ms": None, "itl_p50_ms": None, "stall_ms": None}
    gaps = [(b - a) * 1e3 for a, b in zip(t, t[1:])]
    return {
        "ttft_ms": (t[0] - r.send_s) * 1e3,
        "itl_p50_ms": statistics.median(gaps) if gaps else None,
        "stall_ms": max(gaps) if gaps else None,
    }


def per_request(measured: list[Any], predicted: list[Any] | None) -> list[dict[str, Any]]:
    """One row per request: measured and predicted figures with their relative error."""
    pred = {r.request_id: r for r in predicted or []}
    rows = []
    for r in measured:
        m = _record_figures(r)
        p = _record_figures(pred[r.request_id]) if r.request_id in pred else {}
        row: dict[str, Any] = {"request_id": r.request_id, "kind": r.kind, "prompt_len": r.prompt_len}
        for k in ("ttft_ms", "itl_p50_ms", "stall_ms"):
            row[k] = {"measured": m[k], "predicted": p.get(k), "error": _err(p.get(k), m[k])}
        if r.dispatch:
            d = r.dispatch
            row["dispatch"] = {
                "decision": d.get("decision"),
                "streams_in_flight": d.get("streams_in_flight"),
                "predicted_ttft_ms": d.get(d.get("decision"), {}).get("ttft_ms"),
                "router_ttft_ms": (d.get("outcome") or {}).get("ttft_ms"),
                "router_error": (d.get("outcome") or {}).get("ttft_error"),
                "client_error": _err(d.get(d.get("decision"), {}).get("ttft_ms"), m["ttft_ms"]),
            }
        rows.append(row)
    return rows


HEADLINE = (
    ("decode_step_ms", "decode step (ITL p50)"),
    ("prefill_ms", "document prefill (worker, p50)"),
    ("stall_max_ms", "max stall"),
    ("ttft_p50_ms", "TTFT p50"),
)


def _docs(records: list[Any]) -> list[Any]:
    return [r for r in records if r.kind == "document"]


def _figures(records: list[Any], metrics: Any) -> dict[str, float | None]:
    pre = [r.worker_prefill_ms for r in _docs(records) if r.worker_prefill_ms is not None]
    return {
        "decode_step_ms": metrics.itl_ms.p50,
        "prefill_ms": statistics.median(pre) if pre else None,
        "stall_max_ms": metrics.stall_ms.max,
        "ttft_p50_ms": metrics.ttft_ms.p50,
    }


def _auto_figures(records: list[Any], client_beyond_router_ms: float | None) -> dict[str, float | None]:
    """The router's own predictions (its decisions), read as the four headline figures: the
    chosen placement's decode step and prefill for documents, the longest step a document's
    prefill puts in the streams' way (local: its longest chunk step; remote: the decode step beside
    it), and the p50 of the predicted TTFT plus what the client adds beyond the router's TTFT
    (measured in the warm-up)."""
    chosen = [(r, r.dispatch[r.dispatch["decision"]]) for r in records if r.dispatch]
    docs = [(r, p) for r, p in chosen if r.kind == "document"]
    steps = [p["decode_step_ms"] for r, p in docs if r.dispatch.get("streams_in_flight") and "decode_step_ms" in p]
    pre = [p["prefill_ms"] for _, p in docs if "prefill_ms" in p]
    stall = [p["itl_ms"] if r.dispatch["decision"] == "local" else p.get("decode_step_ms") for r, p in docs]
    ttft = [p["ttft_ms"] + (client_beyond_router_ms or 0.0) for _, p in chosen]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {
        "decode_step_ms": med(steps),
        "prefill_ms": med(pre),
        "stall_max_ms": max((x for x in stall if x is not None), default=None),
        "ttft_p50_ms": med(ttft),
    }


def headline(measured: list[Any], measured_metrics: Any, predicted: list[Any] | None, predicted_metrics: Any,
             auto: bool, client_beyond_router_ms: float | None = None) -> dict[str, Any]:  # fmt: skip
    """{figure: {measured, predicted, error}} for the issue's four figures, and where the
    predictions come from."""
    m = _figures(measured, measured_metrics)
    if auto:
        p, source = _auto_figures(measured, client_beyond_router_ms), "router (its dispatch predictions)"
    elif predicted is not None:
        p, source = _figures(predicted, predicted_metrics), "simulator"
    else:
        p, source = {}, None
    out: dict[str, Any] = {
        k: {"measured": m[k], "predicted": p.get(k), "error": _err(p.get(k), m[k])} for k, _ in HEADLINE
    }
    out["source"] = source
    return out


def accuracy_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Share of requests whose prediction is within 15%, per figure."""
    out: dict[str, Any] = {}
    for k in ("ttft_ms", "itl_p50_ms", "stall_ms"):
        errs = [row[k]["error"] for row in rows if row[k]["error"] is not None]
        out[k] = {"n": len(errs), "within_15pct": _share(errs), "median_abs_error": _med_abs(errs)}
    return out


def _share(errs: list[float]) -> float | None:
    return sum(abs(e) <= WITHIN for e in errs) / len(errs) if errs else None


def _med_abs(errs: list[float]) -> float | None:
    return statistics.median(abs(e) for e in errs) if errs else None


def ttft_by_bucket(measured: list[Any]) -> list[dict[str, Any]]:
    rows, lo = [], 0
    for hi in BUCKETS:
        ts = [f["ttft_ms"] for r in measured if lo < r.prompt_len <= hi and (f := _record_figures(r))["ttft_ms"]]
        if ts:
            label = f"{lo + 1}-{hi}" if hi < BUCKETS[-1] else f">{lo}"
            rows.append({"bucket": label, "n": len(ts), "p50_ms": statistics.median(ts), "max_ms": max(ts)})
        lo = hi
    return rows


def dispatch_summary(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    ds = [row["dispatch"] for row in rows if "dispatch" in row]
    if not ds:
        return None
    counts: dict[str, int] = {}
    for d in ds:
        counts[d["decision"]] = counts.get(d["decision"], 0) + 1
    router = [d["router_error"] for d in ds if d["router_error"] is not None]
    client = [d["client_error"] for d in ds if d["client_error"] is not None]
    return {
        "decisions": counts,
        "ttft_within_15pct_router": _share(router),
        "ttft_within_15pct_client": _share(client),
        "ttft_median_abs_error_router": _med_abs(router),
        "n": len(ds),
        "how": "router: the dispatch's predicted TTFT vs the TTFT the router stamped (arrival to first "
        "token event); client: vs the TTFT the benchmark client measured (adds HTTP/SSE)",
    }


def boundary(calibration: Path, model: str, chunk: int | None, slo_ttft_ms: float, slo_itl_ms: float,
             ctx: int, max_streams: int, max_prompt: int, stream_len: int = 0) -> list[dict[str, Any]]:  # fmt: skip
    """For each count of streams in flight (each at context `ctx`, halfway through `stream_len`
    output tokens if given, empty queues), the shortest prompt the calibrated cost model sends
    remote (None: local up to `max_prompt`)."""
    from costmodel.article.cost_model import Calibration, ModelSpec  # noqa: PLC0415
    from router.dispatch.dispatcher import AutoDispatcher, Stream  # noqa: PLC0415

    d = AutoDispatcher(Calibration.load(calibration), ModelSpec.resolve(model), "fp8", chunk,
                       slo_ttft_ms / 1e3, slo_itl_ms / 1e3)  # fmt: skip
    step = d.fits["decode"].current.decode_seconds([ctx])
    one = Stream(ctx, stream_len // 2, stream_len // 2 * step, stream_len) if stream_len else Stream(ctx)
    out = []
    for s in range(max_streams + 1):
        cut = next(
            (p for p in range(16, max_prompt + 1, 16) if d.decide(p, 0, 0, [one] * s, 0.0).choice == "remote"), None
        )
        out.append({"streams": s, "remote_from_prompt": cut})
    return out


def plot_decisions(mode: dict[str, Any], path: Path) -> Path | None:
    rows = [r for r in mode.get("per_request", []) if "dispatch" in r]
    if not rows:
        return None
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for choice, marker, color in (("local", "o", "tab:blue"), ("remote", "s", "tab:orange")):
        pts = [
            (r["prompt_len"], r["dispatch"]["streams_in_flight"]) for r in rows if r["dispatch"]["decision"] == choice
        ]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, color=color, label=f"{choice} ({len(pts)})", alpha=0.7)
    b = [x for x in mode.get("boundary") or [] if x["remote_from_prompt"] is not None]
    if b:
        ax.step([x["remote_from_prompt"] for x in b], [x["streams"] for x in b], "k--", where="post",
                label="cost-model boundary (remote right of it)")  # fmt: skip
    ax.set(xscale="log", xlabel="prompt tokens", ylabel="streams in flight on the decode worker",
           title="auto: placement per request")  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report_lines(result: dict[str, Any]) -> list[str]:
    """Markdown: the four headline figures, per-request accuracy for every mode, the auto section."""
    out = ["", "## Predicted vs measured: decode step, prefill, max stall, TTFT p50", ""]
    out += ["Each cell: measured / predicted (error). Fixed modes: the simulator; auto: the router's own "
            "dispatch predictions. Target: within 15%.", ""]  # fmt: skip
    out += ["| mode | source | " + " | ".join(f"{label} (ms)" for _, label in HEADLINE) + " |"]
    out += ["|---|---|" + "---|" * len(HEADLINE)]
    for m in result["modes"]:
        h = m.get("headline")
        if not h:
            continue
        cells = [_cell(h[k]) for k, _ in HEADLINE]
        out.append(f"| {m['label']} | {h.get('source') or '-'} | " + " | ".join(cells) + " |")
    out += ["", "## Per-request predictions (simulated with the calibrated step-cost fit) vs measured", ""]
    out += ["| mode | requests | TTFT within 15% | ITL p50 within 15% | max gap within 15% | median abs TTFT error |"]
    out += ["|---|---|---|---|---|---|"]
    for m in result["modes"]:
        a = m.get("accuracy")
        if not a:
            continue
        out.append(
            f"| {m['label']} | {a['ttft_ms']['n']} | {_pc(a['ttft_ms']['within_15pct'])} | "
            f"{_pc(a['itl_p50_ms']['within_15pct'])} | {_pc(a['stall_ms']['within_15pct'])} | "
            f"{_pc(a['ttft_ms']['median_abs_error'])} |"
        )
    for m in result["modes"]:
        d = m.get("dispatch")
        if not d:
            continue
        out += ["", f"## {m['label']}: decisions", ""]
        out.append(
            f"decisions: {', '.join(f'{k} {v}' for k, v in sorted(d['decisions'].items()))}; the router's TTFT "
            f"predictions within 15%: {_pc(d['ttft_within_15pct_router'])} of {d['n']} against the router's "
            f"realized TTFT, {_pc(d['ttft_within_15pct_client'])} against the client's ({d['how']})."
        )
        if m.get("ttft_by_bucket"):
            out += ["", "| prompt tokens | requests | TTFT p50 ms | TTFT max ms |", "|---|---|---|---|"]
            out += [
                f"| {b['bucket']} | {b['n']} | {b['p50_ms']:.0f} | {b['max_ms']:.0f} |" for b in m["ttft_by_bucket"]
            ]
    return out


def _pc(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _cell(x: dict[str, Any]) -> str:
    m, p, e = x.get("measured"), x.get("predicted"), x.get("error")
    if m is None:
        return "-"
    return f"{m:,.1f} / " + ("-" if p is None else f"{p:,.1f}" + ("" if e is None else f" ({e:+.0%})"))
