"""The comparison table of `pdserve bench compare`: one row per mode, measured beside simulated.

It reads the result JSON's dict (what `benchmarks/compare/record.py` builds), never live runs,
so `--from-json` redraws it from a committed result. The same cells feed stdout, the `--json`
summary and the Markdown report's "Measured" table, so the three always agree. The equality
verdict's one-line forms (the near-tie note, the mismatch banner) live here too: they are what
the command prints beside the table.
"""

from __future__ import annotations

from typing import Any

# (header, unit row, getter over a metrics dict)
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


def num(x: Any) -> float | None:
    if x is None:
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def must_num(x: Any) -> float:
    """`num` of a figure that is there by construction (a completed document's arrival or TTFT)."""
    v = num(x)
    if v is None:
        raise ValueError(f"expected a number, got {x!r}")
    return v


def fmt_num(x: Any, digits: int = 1) -> str:
    v = num(x)
    return "-" if v is None else f"{v:,.{digits}f}"


def fmt_pct(x: Any) -> str:
    v = num(x)
    return "-" if v is None else f"{v:+.0%}"


def summary_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per mode: the measured figures of the table and the simulated ones beside them."""
    rows = []
    for m in result["modes"]:
        row: dict[str, Any] = {"mode": m["label"], "error": m.get("error")}
        if "metrics" in m:
            for name, unit, get in _COLUMNS:
                row[f"{name} ({unit})" if unit else name] = num(get(m["metrics"]))
            cmp = (m.get("predicted") or {}).get("compared", {})
            for name, unit, key in _PREDICTED:
                row[f"{name} ({unit}, simulated)"] = num(cmp.get(key, {}).get("predicted"))
        rows.append(row)
    return rows


def table_cells(result: dict[str, Any]) -> tuple[list[str], list[str], list[list[str]]]:
    head = ["mode"] + [c[0] for c in _COLUMNS] + [p[0] for p in _PREDICTED]
    units = [""] + [c[1] for c in _COLUMNS] + [p[1] for p in _PREDICTED]
    rows = []
    for m in result["modes"]:
        if "metrics" not in m:
            rows.append([m["label"], f"FAILED: {m.get('error')}"] + [""] * (len(head) - 2))
            continue
        met = m["metrics"]
        cells = [m["label"]] + [fmt_num(get(met), 2 if name == "goodput" else 1) for name, _, get in _COLUMNS]
        cmp = (m.get("predicted") or {}).get("compared", {})
        cells += [fmt_num(cmp.get(key, {}).get("predicted")) for _, _, key in _PREDICTED]
        rows.append(cells)
    return head, units, rows


def format_table(result: dict[str, Any]) -> str:
    head, units, rows = table_cells(result)
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
    if any(not m.get("endpoint") for m in result["modes"]):  # pdserve's own modes ran
        eq = result["equality"]
        verdict = {True: "IDENTICAL", False: "MISMATCH", None: "not checked"}[eq.get("identical")]
        if eq.get("only_near_ties"):
            verdict = "identical except at near-ties (see report)"
        lines.append(
            f"greedy tokens across modes ({eq.get('compared', 0)} request comparisons vs {eq.get('reference')}): "
            f"{verdict}"
        )
        lines += prediction_notes(result)
    lines += endpoint_notes(result)
    return "\n".join(lines)


def prediction_notes(result: dict[str, Any]) -> list[str]:
    """What the sim columns stand on, per mode, and the SLOs goodput was counted under."""
    from benchmarks.compare.prediction import describe_basis  # noqa: PLC0415

    lines = []
    bases = [(m["label"], m.get("prediction_basis")) for m in result["modes"] if not m.get("endpoint")]
    if any(b for _, b in bases):
        lines.append("sim = the simulator on a calibrated step model (predicted, not measured); per mode:")
        lines += [f"  {label}: {describe_basis(b)}" for label, b in bases if b]
    elif result.get("prediction_setup"):  # a result written before per-mode calibration
        lines.append("sim = simulator + cost model on the calibrated device (predicted, not measured)")
    else:
        lines.append(f"no predictions: {result.get('prediction_error')}")
    slo = result.get("slo") or {}
    if slo.get("ttft_ms") is not None and slo.get("tpot_ms") is not None:
        how = f" ({slo['how']})" if slo.get("how") else ""
        lines.append(f"goodput SLOs: TTFT <= {slo['ttft_ms']:.0f} ms, TPOT <= {slo['tpot_ms']:.0f} ms{how}")
    return lines


def endpoint_notes(result: dict[str, Any]) -> list[str]:
    """One line per server pdserve did not start: where it is, how its greedy output compared
    with pdserve's reference mode, and what its prediction stands on (or why there is none)."""
    lines = []
    for m in result["modes"]:
        ep = m.get("endpoint")
        if not ep:
            continue
        if "metrics" not in m:
            lines.append(f"{m['label']} = {ep['url']}: failed, nothing measured")
            continue
        eq = (result["equality"].get("endpoints") or {}).get(m["label"], {})
        if eq.get("identical") is None:
            same = f"not checked ({eq.get('note')})"
        else:
            what = "token ids" if "token ids" in eq.get("how", "") else "text"
            same = (
                f"{what} identical to {eq['reference']} in all {eq['compared']} requests"
                if eq["identical"]
                else f"{what} differs from {eq['reference']} in {eq['differing']} of {eq['compared']} requests "
                "(informational)"
            )
        pred = ep.get("prediction") or {}
        sim = f"sim: {pred['basis']}" if pred.get("setup") else f"no prediction: {pred.get('error')}"
        lines.append(f"{m['label']} = {ep['url']} ({ep.get('model') or 'model not known'}): greedy {same}; {sim}")
    return lines


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


def ok_modes(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in result["modes"] if "metrics" in m]
