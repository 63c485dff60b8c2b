"""The Markdown report of `pdserve bench compare`, with its plots: `<out-dir>/<name>.md`.

It reads the result JSON's dict, so a report can be redrawn from a committed result
(`pdserve bench compare --from-json FILE`). Sections: the measured table (the same cells as
stdout's, `benchmarks/compare/table.py`), greedy equality, real answers, stall per document,
predicted vs measured, auto's decisions, KV transfers, and a note on what a CPU run can show.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.compare import auto as compare_auto
from benchmarks.compare import demo_samples
from benchmarks.compare.plots import plot_latency, plot_predicted, plot_timelines
from benchmarks.compare.table import endpoint_notes, fmt_num, fmt_pct, must_num, num, ok_modes, table_cells


@dataclass
class ReportFiles:
    markdown: Path
    plots: list[Path] = field(default_factory=list)


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def _measured_section(result: dict[str, Any]) -> list[str]:
    head, units, rows = table_cells(result)
    head = [f"{h} ({u})" if u else h for h, u in zip(head, units)]
    return _md_table(head, rows)


def _documents_section(result: dict[str, Any]) -> list[str]:
    rows = []
    for m in ok_modes(result):
        for d in m["metrics"]["documents"]:
            rows.append(
                [
                    m["label"],
                    d["request_id"],
                    fmt_num(num(d["arrival_s"]), 2),
                    fmt_num(must_num(d["ttft_s"]) * 1e3, 0),
                    fmt_num(None if d.get("stall_s") is None else must_num(d["stall_s"]) * 1e3, 0),
                    fmt_num(d["tokens_lost"]),
                    str(len(d["streams"])),
                ]
            )
    return _md_table(
        ["mode", "document", "sent at (s)", "TTFT (ms)", "stall (ms)", "tokens lost", "streams in flight"], rows
    )


def _predicted_section(result: dict[str, Any]) -> list[str]:
    """One row per mode; each cell: measured / simulated (error of the simulation); then what
    each mode's prediction stood on."""
    from benchmarks.compare.prediction import describe_basis  # noqa: PLC0415
    from costmodel.sim.compare_predict import COMPARED  # noqa: PLC0415

    rows = [
        [m["label"], *_compared_cells(cmp)]
        for m in ok_modes(result)
        if (cmp := (m.get("predicted") or {}).get("compared"))
    ]
    bases = [
        f"- {m['label']}: {describe_basis(m['prediction_basis'])}"
        for m in ok_modes(result)
        if m.get("prediction_basis")
    ]
    head = (
        "Calibration per mode (*self*: fitted to that server's own warm-up steps in this run; *file*: a "
        "calibration file; of the two, the one that predicted the mode's warm-up better is used; *transfer*: "
        "fitted to the same mode's server in an earlier run of another workload (`--transfer-from`), nothing of "
        "this run's):"
    )
    bases = ["", head, "", *bases] if bases else []
    return _md_table(["mode"] + [label for _, label, _ in COMPARED], rows) + bases


def at_pace_section(result: dict[str, Any]) -> list[str]:
    """`--transfer-from`: the same predictions re-priced at each server's pace against the source
    run's (calibrate/serving_pace.py), beside the plain transfer above."""
    from costmodel.sim.compare_predict import COMPARED  # noqa: PLC0415

    paced = [(m["label"], m["predicted_at_server_pace"]) for m in ok_modes(result) if m.get("predicted_at_server_pace")]
    if not paced:
        return []
    rows = [
        [f"{label} ({p['ratio']:.2f}x, {p['matched_steps']} steps)", *_compared_cells(p["compared"])]
        for label, p in paced
    ]
    return [
        "At each server's pace: the transfer above with every step priced at the ratio of this server's lone "
        "prompt steps to the source run's of the same shape (the side prompts every warm-up sends; nothing of "
        "this workload's). Each cell: measured / simulated (error).",
        "",
        *_md_table(["mode (pace, matched)"] + [label for _, label, _ in COMPARED], rows),
        "",
    ]


def _compared_cells(compared: dict[str, Any]) -> list[str]:
    """One cell per figure of COMPARED: measured / simulated (error)."""
    from costmodel.sim.compare_predict import COMPARED  # noqa: PLC0415

    return [
        f"{fmt_num(c['measured'])} / {fmt_num(c['predicted'])} ({fmt_pct(c['error'])})"
        for c in (compared[k] for k, _, _ in COMPARED)
    ]


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
    for m in ok_modes(result):
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
                    fmt_num(t["ms"], 2),
                    fmt_num(t.get("gbytes_per_s"), 2),
                    fmt_num(links.get("nvlink"), 3),
                    fmt_num(links.get("ib-100g"), 3),
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


def _equality_section(eq: dict[str, Any]) -> list[str]:
    """Greedy equality across pdserve's own modes (the endpoints have theirs beside it)."""
    return [
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
    ]


def _endpoint_section(result: dict[str, Any]) -> list[str]:
    notes = endpoint_notes(result)
    if not notes:
        return []
    return [
        "## Servers pdserve did not start (`--endpoint`)",
        "",
        "Driven by the same client with the same warm-up, timed run and equality pass as pdserve's modes. "
        "Their greedy output is compared with the reference mode's by token ids where the server returns them "
        "(pdserve does), else by text; a different model, tokenizer or precision answers differently, so the "
        "comparison never fails the run. Their predictions use the calibration `pdserve bench probe` measured "
        "on them (`--endpoint-calibration NAME=FILE`), simulated in the serving mode the probe inferred.",
        "",
        *(f"- {line}" for line in notes),
        "",
    ]


def write_report(result: dict[str, Any], out_dir: Path, name: str, result_path: Path | None = None) -> ReportFiles:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = ReportFiles(out_dir / f"{name}.md")
    if ok_modes(result):
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
        f"prompts, {wl['chat_output_len']} output tokens, "
        + (f"chat i sent at i x {wl['chat_stagger_s']:g} s" if wl.get("chat_stagger_s") else "all sent at t=0")
        + f") and {wl['doc_count']} documents of "
        f"{wl['doc_prompt_len']} tokens ({wl['doc_output_len']} output tokens) "
        + (
            f"at Poisson rate {wl['doc_rate']}/s from {wl['doc_start_s']} s"
            if wl.get("doc_rate")
            else f"sent at {wl['doc_start_s']} s and every {wl['doc_interval_s']} s after"
        )
        + ". "
        f"Each mode ran on a fresh server; greedy decoding, `ignore_eos`. SLO for goodput: TTFT <= "
        f"{fmt_num(result['slo']['ttft_ms'])} ms and TPOT <= {fmt_num(result['slo']['tpot_ms'])} ms"
        + (f" ({result['slo']['how']})" if result["slo"].get("how") else "")
        + ".",
        "",
        "## Measured",
        "",
        *_measured_section(result),
        "",
        "*max stall*: the longest gap between two tokens of any chat stream in flight while a document was "
        "admitted and prefilled (from its send to its first token); *tok lost*: the tokens those streams "
        "would have produced at their own median pace in that gap, summed over streams, mean per document. "
        "The last two columns are simulated (see below). Load average (1/5/15 min) after each mode: "
        + "; ".join(f"{m['label']} {m.get('load_average')}" for m in ok_modes(result))
        + ".",
        "",
        *(_equality_section(eq) if any(not m.get("endpoint") for m in result["modes"]) else []),
        *_endpoint_section(result),
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
            f"Predictions are **simulated**: the discrete-event simulator (`costmodel/sim/engine.py`) run on the same "
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
            *at_pace_section(result),
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
        if any(m.get("endpoint") and m.get("predicted") for m in result["modes"]):
            lines += ["Endpoints, each cell: measured / simulated (error).", "", *_predicted_section(result), ""]
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
