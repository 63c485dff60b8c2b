"""The PNG plots of the `pdserve bench compare` report, drawn from the result JSON's dict.

- <name>-timeline.png: the chat streams' token arrivals around the first document's arrival,
  one panel per mode; the colocated freeze is the white band across every stream.
- <name>-latency.png: ITL CDF and TTFT per request (chat and document), per mode.
- <name>-predicted.png: measured vs simulated max stall and ITL p99 per mode.

matplotlib is imported only when a plot is drawn (Agg backend: no display on a server).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.compare.record import unpack
from benchmarks.compare.table import must_num, num, ok_modes


def _plt() -> Any:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _save(fig: Any, path: Path) -> Path:
    """Every figure of the report is laid out, written at the same dpi, and closed (pyplot keeps
    open figures alive otherwise)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def _times(r: dict[str, Any]) -> list[float]:
    return unpack(r["chunk_times_s"])


def _first_stalled_document(m: dict[str, Any]) -> dict[str, Any] | None:
    docs = m["metrics"]["documents"]
    return next((d for d in docs if d.get("stall_s") is not None), docs[0] if docs else None)


def plot_timelines(result: dict[str, Any], path: Path) -> Path:
    """Chat token arrivals around the first document (with streams in flight) of each mode."""
    plt = _plt()
    modes = ok_modes(result)
    firsts = [_first_stalled_document(m) for m in modes]
    # wide enough for the slowest mode's document to reach its first token
    span_ms = max([1000.0] + [1.25 * must_num(d["ttft_s"]) * 1e3 for d in firsts if d])
    fig, axes = plt.subplots(len(modes), 1, figsize=(10, 1.2 + 1.7 * len(modes)), sharex=True, squeeze=False)
    for ax, m, d in zip(axes[:, 0], modes, firsts):
        if d is None:
            ax.set_title(f"{m['label']}: no document completed", fontsize=9, loc="left")
            continue
        a = must_num(d["arrival_s"])
        chats = [_times(r) for r in m["records"] if r["kind"] == "chat"]
        ax.eventplot(
            [[(t - a) * 1e3 for t in ts] for ts in chats if ts], colors="tab:blue", linelengths=0.7, linewidths=0.8
        )
        docs = m["metrics"]["documents"]
        shown = [x for x in docs if -0.25 * span_ms < (must_num(x["arrival_s"]) - a) * 1e3 < span_ms]
        for j, x in enumerate(shown):  # a later document may fall inside the window too
            xa = (must_num(x["arrival_s"]) - a) * 1e3
            ax.axvspan(
                xa,
                (must_num(x["first_token_s"]) - a) * 1e3,
                color=("tab:orange", "tab:red")[j % 2],
                alpha=0.15,
                label=f"{x['request_id']}: sent to first token",
            )
            ax.axvline(xa, color=("tab:orange", "tab:red")[j % 2], lw=1)
        stall = num(d.get("stall_s"))
        ax.set_title(
            f"{m['label']}: longest gap of a stream in flight "
            f"{'-' if stall is None else f'{stall * 1e3:.0f} ms'}, {d['request_id']} TTFT "
            f"{must_num(d['ttft_s']) * 1e3:.0f} ms",
            fontsize=9,
            loc="left",
        )
        ax.set_ylabel("chat stream")
        ax.set_yticks([])
        ax.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlim(-0.25 * span_ms, span_ms)
    axes[-1, 0].set_xlabel("time from the document's arrival (ms); each tick is a streamed token")
    fig.suptitle(
        f"Token arrivals of the chat streams around a {result['workload']['doc_prompt_len']}-token "
        f"document ({result['model']} on {result['device']})",
        fontsize=10,
    )
    return _save(fig, path)


def plot_latency(result: dict[str, Any], path: Path) -> Path:
    """ITL CDF per mode, and each request's TTFT per mode (dots: chats, triangles: documents)."""
    plt = _plt()
    modes = ok_modes(result)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for m in modes:
        gaps = sorted(
            (b - a) * 1e3
            for r in m["records"]
            if r.get("error") is None
            for ts in [_times(r)]
            for a, b in zip(ts, ts[1:])
        )
        if gaps:
            a1.step(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], where="post", label=m["label"])
    a1.set_xscale("log")
    from matplotlib.ticker import ScalarFormatter  # noqa: PLC0415

    a1.xaxis.set_major_formatter(ScalarFormatter())
    a1.xaxis.set_minor_formatter(ScalarFormatter())
    a1.tick_params(axis="x", which="minor", labelsize=7)
    a1.set_xlabel("inter-token latency (ms, log)")
    a1.set_ylabel("fraction of gaps <= x")
    a1.set_title("ITL distribution (all streams, all gaps)", fontsize=10)
    a1.grid(alpha=0.3, which="both")
    a1.legend(fontsize=8)
    for i, m in enumerate(modes):
        for kind, marker, color in (("chat", "o", "tab:blue"), ("document", "^", "tab:red")):
            ys = [
                (ts[0] - r["send_s"]) * 1e3
                for r in m["records"]
                for ts in [_times(r)]
                if r["kind"] == kind and r.get("error") is None and ts
            ]
            a2.scatter(
                [i + (0.12 if kind == "document" else -0.12)] * len(ys),
                ys,
                marker=marker,
                color=color,
                alpha=0.7,
                s=22,
                label=kind if i == 0 else None,
            )
    a2.set_xticks(range(len(modes)), [m["label"] for m in modes], fontsize=8)
    a2.set_yscale("log")
    a2.set_ylabel("TTFT (ms, log)")
    a2.set_title("TTFT per request", fontsize=10)
    a2.grid(alpha=0.3, axis="y", which="both")
    a2.legend(fontsize=8)
    return _save(fig, path)


def plot_predicted(result: dict[str, Any], path: Path) -> Path:
    """Measured vs simulated max stall and ITL p99, per mode."""
    plt = _plt()
    modes = [m for m in ok_modes(result) if m.get("predicted")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, (key, title) in zip(
        axes, (("stall_max_ms", "max stall at a document arrival (ms)"), ("itl_p99_ms", "ITL p99 (ms)"))
    ):
        xs = range(len(modes))
        meas = [num(m["predicted"]["compared"][key]["measured"]) or 0 for m in modes]
        pred = [num(m["predicted"]["compared"][key]["predicted"]) or 0 for m in modes]
        ax.bar([x - 0.2 for x in xs], meas, 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], pred, 0.4, label="simulated (cost model, calibrated)", hatch="//", alpha=0.7)
        ax.set_xticks(list(xs), [m["label"] for m in modes], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    return _save(fig, path)
