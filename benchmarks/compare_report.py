"""The `pdserve bench compare` report: one summary table, a Markdown file and PNG plots.

Everything here reads the result JSON's dict (what `bench_compare` writes), so a report can be
redrawn from a committed result (`pdserve bench compare --from-json FILE`). Plots:
- <name>-timeline.png: the chat streams' token arrivals around the first document's arrival,
  one panel per mode; the colocated freeze is the white band across every stream.
- <name>-latency.png: ITL CDF and TTFT per request (chat and document), per mode.
- <name>-predicted.png: measured vs simulated max stall and ITL p99 per mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import compare_auto, demo_samples


def pack(times: list[float]) -> str:
    """Timestamps as one string of space-separated seconds, to 0.01 ms: with the JSON indented
    one number per line, per-token lists would make the file ten times larger."""
    return " ".join(f"{t:.5f}" for t in times)


def unpack(text: str | list, cast: type = float) -> list:
    """Inverse of the packing of `chunk_times_s` (float) and `token_ids` (cast=int) in the result JSON."""
    return [cast(x) for x in text.split()] if isinstance(text, str) else list(text)


# (header, unit row, getter over a metrics dict)
_COLUMNS: list[tuple[str, str, Any]] = [
    ("TTFT p50", "ms", lambda m: m["ttft_ms"]["p50"]),
    ("TTFT p99", "ms", lambda m: m["ttft_ms"]["p99"]),
    ("ITL p50", "ms", lambda m: m["itl_ms"]["p50"]),
    ("ITL p99", "ms", lambda m: m["itl_ms"]["p99"]),
    ("TPOT p50", "ms", lambda m: m["tpot_ms"]["p50"]),
    ("max stall", "ms", lambda m: m["stall_ms"]["max"]),
    ("tok lost", "/doc", lambda m: m["tokens_lost"]["mean"]),
    ("out tok/s", "", lambda m: m["output_throughput"]),
    ("goodput", "req/s", lambda m: m["goodput"]),
]
_PREDICTED = [("sim stall", "ms", "stall_max_ms"), ("sim ITL p99", "ms", "itl_p99_ms")]


@dataclass
class ReportFiles:
    markdown: Path
    plots: list[Path] = field(default_factory=list)


def _num(x: Any) -> float | None:
    if x is None:
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _f(x: Any, digits: int = 1) -> str:
    v = _num(x)
    return "-" if v is None else f"{v:,.{digits}f}"


def _pct(x: Any) -> str:
    v = _num(x)
    return "-" if v is None else f"{v:+.0%}"


def summary_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per mode: the measured figures of the table and the simulated ones beside them."""
    rows = []
    for m in result["modes"]:
        row: dict[str, Any] = {"mode": m["label"], "error": m.get("error")}
        if "metrics" in m:
            for name, unit, get in _COLUMNS:
                row[f"{name} ({unit})" if unit else name] = _num(get(m["metrics"]))
            cmp = (m.get("predicted") or {}).get("compared", {})
            for name, unit, key in _PREDICTED:
                row[f"{name} ({unit}, simulated)"] = _num(cmp.get(key, {}).get("predicted"))
        rows.append(row)
    return rows


def _table_cells(result: dict[str, Any]) -> tuple[list[str], list[str], list[list[str]]]:
    head = ["mode"] + [c[0] for c in _COLUMNS] + [p[0] for p in _PREDICTED]
    units = [""] + [c[1] for c in _COLUMNS] + [p[1] for p in _PREDICTED]
    rows = []
    for m in result["modes"]:
        if "metrics" not in m:
            rows.append([m["label"], f"FAILED: {m.get('error')}"] + [""] * (len(head) - 2))
            continue
        met = m["metrics"]
        cells = [m["label"]] + [_f(get(met), 2 if name == "goodput" else 1) for name, _, get in _COLUMNS]
        cmp = (m.get("predicted") or {}).get("compared", {})
        cells += [_f(cmp.get(key, {}).get("predicted")) for _, _, key in _PREDICTED]
        rows.append(cells)
    return head, units, rows


def format_table(result: dict[str, Any]) -> str:
    head, units, rows = _table_cells(result)
    w = [
        max(len(head[i]), len(units[i]), *(len(r[i]) for r in rows if len(r) > i and not r[1].startswith("FAILED")))
        for i in range(len(head))
    ]
    fmt = lambda cells: "  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(cells))  # noqa: E731
    wl = result["workload"]
    title = (
        f"pdserve bench compare: {result['model']} on {result['device']}; {wl['chat_streams']} chat streams x "
        f"{wl['chat_output_len']} tokens, {wl['doc_count']} documents of {wl['doc_prompt_len']} tokens"
    )
    lines = [title, fmt(head), fmt(units), "-" * (sum(w) + 2 * (len(w) - 1))]
    lines += [fmt(r) if not r[1].startswith("FAILED") else f"{r[0]}  {r[1]}" for r in rows]
    eq = result["equality"]
    verdict = {True: "IDENTICAL", False: "MISMATCH", None: "not checked"}[eq.get("identical")]
    if eq.get("only_near_ties"):
        verdict = "identical except at near-ties (see report)"
    lines.append(
        f"greedy tokens across modes ({eq.get('compared', 0)} request comparisons vs {eq.get('reference')}): {verdict}"
    )
    lines.append(
        "sim = simulator + cost model on the calibrated device (predicted, not measured)"
        if result.get("prediction_setup")
        else f"no predictions: {result.get('prediction_error')}"
    )
    return "\n".join(lines)


def near_tie_note(eq: dict[str, Any]) -> str:
    """Greedy runs that part only where the reference's top-2 choice was a near-tie."""
    where = "; ".join(
        f"{m['mode']} {m['request_id']} from token {m['first_difference']} (top-2 margin {m['reference_margin']} nats)"
        for m in eq.get("mismatches", [])[:10]
    )
    return (
        f"greedy tokens: {len(eq.get('mismatches', []))} of {eq.get('compared')} requests part from the "
        f"{eq.get('reference')} reference, each at a near-tie (top-2 logprob margin < {eq.get('near_tie_nats')} "
        f"nats, where FP8 KV rounding may flip the choice): {where}"
    )


def mismatch_banner(eq: dict[str, Any]) -> str:
    lines = [
        "!" * 78,
        "!! GREEDY TOKEN MISMATCH between serving modes: the same request gave different tokens",
        f"!! reference mode: {eq.get('reference')}",
    ]
    for mm in eq.get("mismatches", [])[:20]:
        lines.append(
            f"!!   {mm['mode']}: {mm['request_id']} differs from token {mm['first_difference']} "
            f"(lengths {mm['reference_len']} vs {mm['got_len']})"
        )
    lines.append("!" * 78)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots


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


def _ok_modes(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in result["modes"] if "metrics" in m]


def _times(r: dict[str, Any]) -> list[float]:
    return unpack(r["chunk_times_s"])


def _first_stalled_document(m: dict[str, Any]) -> dict[str, Any] | None:
    docs = m["metrics"]["documents"]
    return next((d for d in docs if d.get("stall_s") is not None), docs[0] if docs else None)


def plot_timelines(result: dict[str, Any], path: Path) -> Path:
    """Chat token arrivals around the first document (with streams in flight) of each mode."""
    plt = _plt()
    modes = _ok_modes(result)
    firsts = [_first_stalled_document(m) for m in modes]
    # wide enough for the slowest mode's document to reach its first token
    span_ms = max([1000.0] + [1.25 * _num(d["ttft_s"]) * 1e3 for d in firsts if d])
    fig, axes = plt.subplots(len(modes), 1, figsize=(10, 1.2 + 1.7 * len(modes)), sharex=True, squeeze=False)
    for ax, m, d in zip(axes[:, 0], modes, firsts):
        if d is None:
            ax.set_title(f"{m['label']}: no document completed", fontsize=9, loc="left")
            continue
        a = _num(d["arrival_s"])
        chats = [_times(r) for r in m["records"] if r["kind"] == "chat"]
        ax.eventplot(
            [[(t - a) * 1e3 for t in ts] for ts in chats if ts], colors="tab:blue", linelengths=0.7, linewidths=0.8
        )
        shown = [x for x in m["metrics"]["documents"] if -0.25 * span_ms < (_num(x["arrival_s"]) - a) * 1e3 < span_ms]
        for j, x in enumerate(shown):  # a later document may fall inside the window too
            xa = (_num(x["arrival_s"]) - a) * 1e3
            ax.axvspan(
                xa,
                (_num(x["first_token_s"]) - a) * 1e3,
                color=("tab:orange", "tab:red")[j % 2],
                alpha=0.15,
                label=f"{x['request_id']}: sent to first token",
            )
            ax.axvline(xa, color=("tab:orange", "tab:red")[j % 2], lw=1)
        stall = _num(d.get("stall_s"))
        ax.set_title(
            f"{m['label']}: longest gap of a stream in flight "
            f"{'-' if stall is None else f'{stall * 1e3:.0f} ms'}, {d['request_id']} TTFT "
            f"{_num(d['ttft_s']) * 1e3:.0f} ms",
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
    modes = _ok_modes(result)
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
    modes = [m for m in _ok_modes(result) if m.get("predicted")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, (key, title) in zip(
        axes, (("stall_max_ms", "max stall at a document arrival (ms)"), ("itl_p99_ms", "ITL p99 (ms)"))
    ):
        xs = range(len(modes))
        meas = [_num(m["predicted"]["compared"][key]["measured"]) or 0 for m in modes]
        pred = [_num(m["predicted"]["compared"][key]["predicted"]) or 0 for m in modes]
        ax.bar([x - 0.2 for x in xs], meas, 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], pred, 0.4, label="simulated (cost model, calibrated)", hatch="//", alpha=0.7)
        ax.set_xticks(list(xs), [m["label"] for m in modes], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    return _save(fig, path)


# ----------------------------------------------------------------------------- Markdown


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def _measured_section(result: dict[str, Any]) -> list[str]:
    head, units, rows = _table_cells(result)
    head = [f"{h} ({u})" if u else h for h, u in zip(head, units)]
    return _md_table(head, rows)


def _documents_section(result: dict[str, Any]) -> list[str]:
    rows = []
    for m in _ok_modes(result):
        for d in m["metrics"]["documents"]:
            rows.append(
                [
                    m["label"],
                    d["request_id"],
                    _f(_num(d["arrival_s"]), 2),
                    _f(_num(d["ttft_s"]) * 1e3, 0),
                    _f(None if d.get("stall_s") is None else _num(d["stall_s"]) * 1e3, 0),
                    _f(d["tokens_lost"]),
                    str(len(d["streams"])),
                ]
            )
    return _md_table(
        ["mode", "document", "sent at (s)", "TTFT (ms)", "stall (ms)", "tokens lost", "streams in flight"], rows
    )


def _predicted_section(result: dict[str, Any]) -> list[str]:
    """One row per mode; each cell: measured / simulated (error of the simulation)."""
    from costmodel.compare_predict import COMPARED  # noqa: PLC0415

    rows = []
    for m in _ok_modes(result):
        cmp = (m.get("predicted") or {}).get("compared")
        if cmp:
            rows.append(
                [m["label"]]
                + [
                    f"{_f(cmp[k]['measured'])} / {_f(cmp[k]['predicted'])} ({_pct(cmp[k]['error'])})"
                    for k, _, _ in COMPARED
                ]
            )
    return _md_table(["mode"] + [label for _, label, _ in COMPARED], rows)


def _reference_lines(ref: dict[str, Any] | None) -> list[str]:
    if not ref:
        return []
    line = (
        f"The cost model prices one document prefill at {ref['doc_prefill_ms_predicted']:.0f} ms and a decode "
        f"step of {ref['decode_step_batch']} streams at context {ref['decode_step_context']} at "
        f"{ref['decode_step_ms_predicted']:.1f} ms"
    )
    if "doc_prefill_ms_measured_by_bench_chunks" in ref:
        line += (
            f"; `pdserve bench chunks` measured the same whole prefill at "
            f"{ref['doc_prefill_ms_measured_by_bench_chunks']:.0f} ms on its own ({ref['bench_chunks_result']}), "
            f"{ref['doc_prefill_ms_measured_by_bench_chunks'] / ref['doc_prefill_ms_predicted']:.1f}x the model's "
            "figure: the calibration carries one prefill rate, fit over every chunk size of the sweep"
        )
    return [line + ".", ""]


def _transfer_section(result: dict[str, Any]) -> list[str]:
    rows = []
    for m in _ok_modes(result):
        for t in m.get("transfers", []):
            if not str(t["request_id"]).startswith("doc"):
                continue
            links = t.get("link_ms", {})
            rows.append(
                [
                    m["label"],
                    t["request_id"],
                    t.get("backend", "?"),
                    f"{t['bytes']:,}",
                    _f(t["ms"], 2),
                    _f(t.get("gbytes_per_s"), 2),
                    _f(links.get("nvlink"), 3),
                    _f(links.get("ib-100g"), 3),
                ]
            )
    if not rows:
        return []
    return [
        "## KV transfer (disaggregated, documents, timed run)",
        "",
        *_md_table(
            ["mode", "request", "backend", "bytes", "ms", "GB/s", "NVLink ms (article)", "100G IB ms (article)"], rows
        ),
        "",
    ]


def write_report(result: dict[str, Any], out_dir: Path, name: str, result_path: Path | None = None) -> ReportFiles:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = ReportFiles(out_dir / f"{name}.md")
    if _ok_modes(result):
        files.plots += [
            plot_timelines(result, out_dir / f"{name}-timeline.png"),
            plot_latency(result, out_dir / f"{name}-latency.png"),
        ]
        if any(m.get("predicted") for m in result["modes"]):
            files.plots.append(plot_predicted(result, out_dir / f"{name}-predicted.png"))
        for m in result["modes"]:
            if m.get("dispatch"):
                p = compare_auto.plot_decisions(m, out_dir / f"{name}-{m['label']}-decisions.png")
                if p is not None:
                    files.plots.append(p)
    prov, wl, eq = result.get("provenance", {}), result["workload"], result["equality"]
    machine = prov.get("machine", {})
    ps = result.get("prediction_setup")
    lines = [
        f"# pdserve bench compare: {result['model']} on {result['device']}",
        "",
        f"Measured on `{machine.get('hostname', '?')}` ({machine.get('cpu', '?')}, {machine.get('cores', '?')} "
        f"cores; device: {prov.get('device', {}).get('name', result['device'])}), {prov.get('date_utc', '?')}, "
        f"commit `{(prov.get('git_commit') or '?')[:10]}`{' (dirty)' if prov.get('git_dirty') else ''}.",
        f"Command: `{prov.get('command', '?')}`" + (f"; result: `{result_path.name}`" if result_path else ""),
        "",
        f"Workload (article mix, seed {wl['seed']}): {wl['chat_streams']} chat streams ({wl['chat_prompt_len']}-token "
        f"prompts, {wl['chat_output_len']} output tokens, all sent at t=0) and {wl['doc_count']} documents of "
        f"{wl['doc_prompt_len']} tokens ({wl['doc_output_len']} output tokens) "
        + (
            f"at Poisson rate {wl['doc_rate']}/s from {wl['doc_start_s']} s"
            if wl.get("doc_rate")
            else f"sent at {wl['doc_start_s']} s and every {wl['doc_interval_s']} s after"
        )
        + ". "
        f"Each mode ran on a fresh server; greedy decoding, `ignore_eos`. SLO for goodput: TTFT <= "
        f"{result['slo']['ttft_ms']} ms and TPOT <= {result['slo']['tpot_ms']} ms.",
        "",
        "## Measured",
        "",
        *_measured_section(result),
        "",
        "*max stall*: the longest gap between two tokens of any chat stream in flight while a document was "
        "admitted and prefilled (from its send to its first token); *tok lost*: the tokens those streams "
        "would have produced at their own median pace in that gap, summed over streams, mean per document. "
        "The last two columns are simulated (see below). Load average (1/5/15 min) after each mode: "
        + "; ".join(f"{m['label']} {m.get('load_average')}" for m in _ok_modes(result))
        + ".",
        "",
        "## Greedy equality across modes",
        "",
        {
            True: f"**Identical.** All {eq.get('requests')} requests returned the same greedy token ids in every mode "
            f"({', '.join(eq.get('modes', []))}; {eq.get('compared')} comparisons against {eq.get('reference')}).",
            False: f"**MISMATCH** in {len(eq.get('mismatches', []))} of {eq.get('compared')} comparisons against "
            f"{eq.get('reference')}: "
            + "; ".join(
                f"{x['mode']} {x['request_id']} from token {x['first_difference']}"
                for x in eq.get("mismatches", [])[:10]
            ),
            None: f"Not checked: {eq.get('note')}.",
        }[eq.get("identical")]
        + (
            f" Each difference starts where the {eq.get('reference')} run's greedy choice was a near-tie "
            f"(top-2 logprob margin below {eq.get('near_tie_nats')} nats; margins: "
            + ", ".join(str(x.get("reference_margin")) for x in eq.get("mismatches", [])[:10])
            + "): the FP8 KV of a real model, quantized from activations that differ in their last bits "
            "between batch shapes and chunk sizes, can flip such a choice. Random-weight models are scaled so "
            "that greedy margins are far larger; for them any difference is a bug."
            if eq.get("only_near_ties")
            else ""
        ),
        f"Method: {eq.get('how', '-')}. The streamed text of the timed runs was "
        f"{'identical too' if eq.get('timed_text_identical') else 'NOT identical'} across modes.",
        "",
        *demo_samples.report_section(result["modes"]),
        "## Stall per document",
        "",
        *_documents_section(result),
        "",
        "## Predicted (simulated) vs measured",
        "",
    ]
    if ps:
        lines += [
            f"Predictions are **simulated**: the discrete-event simulator (`costmodel/sim_engine.py`) run on the same "
            f"requests, with step times from the cost model on a calibrated device: {ps['source']}. "
            f"Device model: {ps['mem_bw_gbps']:.1f} GB/s, "
            f"{', '.join(f'{v:.3f} TFLOP/s {k}' for k, v in ps['peak_tflops'].items())} "
            f"peak at MFU {ps['mfu']:.2f}, decode step overhead {ps['decode_step_overhead_ms']:.1f} ms, "
            f"per prefill/chunk overhead {ps['prefill_overhead_ms']:.1f} ms; KV link: {ps['link']['label']}. "
            "Metrics are computed from the simulated token times with the same formulas as the measured ones.",
            "",
            *_reference_lines(result.get("prediction_reference")),
            "Each cell: measured / simulated (error = (simulated - measured) / measured).",
            "",
            *_predicted_section(result),
            "",
            "Not in the model: the HTTP/SSE and Ray hop per token, the router's event pump, Python scheduling "
            "between steps, and, on a CPU, the prefill and decode processes of a disaggregated run sharing the "
            "same cores (the simulator gives each worker its own device). pdserve's colocated engine also runs "
            "a whole prompt in the same forward pass as the decode batch, where the simulator runs it as its own "
            "step; the stall is about the same (prefill + one decode step). With a calibration that has a "
            "step-cost fit, the simulator prices each step from its shape and runs the whole prompt with the "
            "decode batch, as the engine does.",
            "",
        ]
    else:
        lines += [f"No predictions: {result.get('prediction_error')}", ""]
    lines += compare_auto.report_lines(result) + [""]
    lines += _transfer_section(result)
    if result["device"] == "cpu":
        cores = machine.get("cores", "?")
        lines += [
            "## On this machine",
            "",
            f"This is a {cores}-core CPU run of the {result['model']} model. Disaggregation cannot give the "
            "decode pool its own hardware here: the prefill and decode actors are separate processes competing "
            "for the same cores, so a document's prefill still slows the decode steps that run beside it "
            "(by CPU contention, not by the scheduler). On GPUs each pool gets its own device. The absolute "
            "numbers are CPU numbers; the shape (a freeze when a long prompt is prefilled in a decode step) "
            "is the article's.",
            "",
        ]
    if files.plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in files.plots] + [""]
    files.markdown.write_text("\n".join(lines))
    return files
