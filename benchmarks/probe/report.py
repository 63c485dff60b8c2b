"""What a probe shows: the summary (text and Markdown, one renderer) and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _ms(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x * 1e3:,.{digits}f}"


def _table(head: list[str], rows: list[list[str]], md: bool) -> list[str]:
    if md:
        return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]
    w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    return [
        "  ".join(h.rjust(w[i]) for i, h in enumerate(head)),
        *("  ".join(c.rjust(w[i]) for i, c in enumerate(r)) for r in rows),
    ]


def _decode(df: dict[str, Any], point: dict[str, Any]) -> float:
    b = point["batch"]
    return df["fixed_s"] + df["per_sequence_s"] * b + df["per_context_token_s"] * b * point["context"]


def _break_even(x: float | None) -> str:
    if x is None:
        return "none (prefill costs nothing per token in the fit)"
    if x < 1:
        return "< 1 token (a prefill's fixed cost alone is longer than a decode step)"
    return f"{x:.0f} tokens"


def _prefill(fp: dict[str, Any], tokens: int) -> float:
    return fp["fixed_s"] + fp["linear_s"] * tokens + fp["quadratic_s"] * tokens**2


def _anchor(d: dict[str, Any]) -> dict[str, Any]:
    """The prefill sample the fit's TTFT differences were taken from."""
    t = d["prefill_fit"].get("anchor_tokens") or d["prefill"][0]["tokens"]
    return next(p for p in d["prefill"] if p["tokens"] == t)


def _prefill_basis(d: dict[str, Any]) -> str:
    fp, a = d["prefill_fit"], _anchor(d)
    floor = f"the idle request's {_ms(d['overhead']['ttft_s'])} ms"
    if fp["points"] > 1:
        return (
            f"prefill fitted on TTFT differences from the {a['tokens']}-token prompt's ({fp['points']} prompts clear "
            f"of the latency floor, {floor}; the request's overhead cancels)"
        )
    return (
        f"prefill: the {a['tokens']}-token prompt's TTFT less the overhead, linear in T (the only prompt clear of "
        f"the latency floor, {floor})"
    )


def _article_mix(mix: dict[str, Any], md: bool) -> list[str]:
    """The forecast for the article mix, and the command that measures it."""
    how = (
        "prefill in another pool: the decode steps while it runs there, as slowed as the tax measured"
        if mix["prefill_elsewhere"]
        else f"chunks of {mix['chunk']}"
        if mix["chunk"]
        else "whole prompt"
    )
    chk = mix["check"]
    cmd = f"`{mix['check_command']}`" if md else "  " + mix["check_command"]
    return [
        f"article mix ({mix['chat_streams']} chat streams at context {mix['context']}, "
        f"{mix['doc_prompt_tokens']}-token documents): predicted stall median {mix['predicted_stall_ms']:.1f} ms, "
        f"p90 {mix['predicted_p90_ms']:.1f} ms ({how}; the longest of {mix['window_steps']} steps, costliest "
        f"{mix['costliest_step_ms']:.1f} ms, each plus the serving jitter of {mix['jitter_samples']} measured steps); "
        f"document TTFT {mix['predicted_doc_ttft_ms']:,.0f} ms",
        "",
        f"measure it ({chk['doc_count']} documents, one every {chk['doc_interval_s']:g} s from "
        f"{chk['doc_start_s']:g} s, each arriving while the streams decode; compare the stall's median and p90; "
        "fresh documents each run):",
        "",
        cmd,
    ]


def render(d: dict[str, Any], md: bool = False) -> str:
    """`d` is ProbeResult.to_dict(): the same text on the terminal and in the .md file."""
    df, fp, sf, t = d["decode_fit"], d["prefill_fit"], d["step_fit"], d["tables"]
    h = "## " if md else ""
    out = [
        f"{h}pdserve bench probe: {d['model']} at {d['base_url']}",
        "",
        f"prompts as {'token ids' if d['prompts'] == 'ids' else 'text (lengths from usage.prompt_tokens)'}; "
        f"idle request overhead {_ms(d['overhead']['ttft_s'])} ms (HTTP and scheduling: "
        f"{_ms(d['http_overhead_s'])} ms); probe took {d['wall_s']:.0f} s",
        "",
        f"{h}Fit (non-negative least squares on relative error)",
        "",
        *_table(
            ["", "fixed (ms)", "per sequence (ms)", "per context token (us)", "quadratic (ns/token^2)", "rms error"],
            [
                [
                    "decode step",
                    f"{df['fixed_s'] * 1e3:.3f}",
                    f"{df['per_sequence_s'] * 1e3:.3f}",
                    f"{df['per_context_token_s'] * 1e6:.4f}",
                    "",
                    f"{df['rms_rel_error']:.1%}",
                ],
                [
                    "prefill",
                    f"{fp['fixed_s'] * 1e3:.3f}",
                    f"{fp['linear_s'] * 1e3:.4f} /token",
                    "",
                    f"{fp['quadratic_s'] * 1e9:.4f}",
                    f"{fp['rms_rel_error']:.1%}",
                ],
            ],
            md,
        ),
        "",
        _prefill_basis(d),
        "",
        f"calibration step fit: {sf['fixed_ms']:.3f} ms/step + {sf['per_token_us']:.2f} us/token + "
        f"{sf['attention_ns_per_pair']:.4f} ns/attention pair + {sf['per_sequence_us']:.1f} us/decode sequence"
        + (
            f" + {sf['per_prompt_ms']:.3f} ms/prompt chunk + {sf['context_read_us_per_token']:.3f} us/context token a "
            "chunk reads"
            if sf.get("per_prompt_ms") or sf.get("context_read_us_per_token")
            else ""
        )
        + f" (rms error {sf['rms_rel_error']:.1%} over {sf['samples']} points)",
        "",
        f"{h}Measured",
        "",
        *_table(
            ["batch", "prompt", "decode step (ms)", "fitted (ms)", "1st->2nd token (ms)"],
            [
                [
                    str(s["batch"]),
                    str(s["prompt_tokens"]),
                    _ms(s["point"]["step_s"], 2),
                    _ms(_decode(df, s["point"]), 2),
                    _ms(s["first_to_second_token_s"], 2),
                ]
                for s in d["decode"]
            ],
            md,
        ),
        "",
        *_table(
            [
                "prompt tokens",
                "TTFT (ms)",
                f"TTFT - {_anchor(d)['tokens']}-token's (ms)",
                "fitted (ms)",
                "prefill fitted (ms)",
                "server's own (ms)",
            ],
            [
                [
                    str(p["tokens"]),
                    _ms(p["ttft_s"]),
                    *(
                        [
                            _ms(p["ttft_s"] - _anchor(d)["ttft_s"]),
                            _ms(_prefill(fp, p["tokens"]) - _prefill(fp, _anchor(d)["tokens"])),
                        ]
                        if p["tokens"] >= _anchor(d)["tokens"]
                        else ["under the floor", "-"]
                    ),
                    _ms(_prefill(fp, p["tokens"])),
                    "-" if p["server_prefill_ms"] is None else f"{p['server_prefill_ms']:.1f}",
                ]
                for p in d["prefill"]
            ],
            md,
        ),
        "",
        f"{h}The tax: one prompt arrives while streams decode",
        "",
        *_table(
            [
                "batch",
                "prompt tokens",
                "stall (ms)",
                "predicted median / p90 (ms)",
                "tokens lost",
                "steps during prefill",
            ],
            [
                [
                    str(s["batch"]),
                    str(s["prompt_tokens"]),
                    "-" if s["measured_stall_ms"] is None else f"{s['measured_stall_ms']:.1f}",
                    f"{s['predicted_stall_ms']:.1f} / {s['predicted_p90_ms']:.1f}",
                    f"{s['tokens_lost']:.1f}",
                    f"{x['steps_during']:g}",
                ]
                for s, x in zip(t["stalls"], d["tax"])
            ],
            md,
        ),
        "",
        f"chunking (inferred): {d['chunking']['verdict']}: {d['chunking']['why']}",
    ]
    out += _article_mix(t["article_mix"], md)
    pc = d["prefix"]
    if pc:
        told = pc.get("reported_cached_tokens")
        how = "inferred" if told is None else f"reported: {told} cached tokens"
        out.append(
            f"prefix caching ({how}): {'yes' if pc['cached'] else 'not seen'}: the same {pc['tokens']}-token "
            f"prompt twice, TTFT {_ms(pc['first_ttft_s'])} then {_ms(pc['second_ttft_s'])} ms"
        )
    if d.get("cached_chunks"):
        out += [
            "",
            f"{h}A chunk at an offset: fresh tokens after a prefix the server had just cached",
            "",
            *_table(
                ["cached prefix", "fresh tokens", "TTFT (ms)"],
                [[str(k["start"]), str(k["tokens"]), _ms(k["ttft_s"])] for k in d["cached_chunks"]],
                md,
            ),
            "",
            "(fitted with the rest, the calibration's step fit above: where the prefixes are 2x apart or more, "
            "a chunk's own cost and its read of the context are priced apart)",
        ]
    if sp := d.get("prompt_thread_speedup"):
        ratios = ", ".join(f"{r:.2f}x at {n} tokens" for n, r in sp["speedup_by_prompt_tokens"].items())
        out += [
            "",
            f"this host, the model's forward on {sp['to_threads']} threads against {sp['from_threads']}: {ratios} "
            "(what a colocated whole server here gives its prompt steps; `pdserve plan` prices it)",
        ]
    out += [
        "",
        f"{h}The article's arithmetic for this server (decode at context {t['context']})",
        "",
        *_table(
            ["prompt tokens", "batch", "prefill (ms)", "decode step (ms)", "costs generated tokens"],
            [
                [
                    str(r["prompt_tokens"]),
                    str(r["batch"]),
                    f"{r['prefill_ms']:.1f}",
                    f"{r['decode_step_ms']:.2f}",
                    f"{r['generated_tokens']:,.0f}",
                ]
                for r in t["headline"]
            ],  # fmt: skip
            md,
        ),
        "",
        "break-even chunk (its prefill takes one batch-1 decode step): " + _break_even(t["break_even_chunk"]),
        "",
        *_table(
            ["chunk", "chunk (ms)", "decode steps lost"],
            [[str(r["chunk"]), f"{r['chunk_ms']:.1f}", f"{r['decode_steps']:.2f}"] for r in t["chunks"]],
            md,
        ),
        "",
        *_table(
            [
                f"{t['capacity_prompt_tokens']}-token prefills/s",
                "server time on prefill",
                f"batch-{t['capacity_batch']} sequences that still fit",
            ],
            [
                [f"{r['prefills_per_s']:.2f}", f"{r['share']:.0%}", f"{r['decode_sequences']:.1f}"]
                for r in t["capacity"]
            ],
            md,
        ),  # fmt: skip
    ]
    return "\n".join(out)


def plot(d: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only the plot needs matplotlib
    import matplotlib.ticker  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    df, fp = d["decode_fit"], d["prefill_fit"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4.2))
    for ctx in sorted({s["prompt_tokens"] for s in d["decode"]}):
        pts = [s for s in d["decode"] if s["prompt_tokens"] == ctx]
        xs = [s["batch"] for s in pts]
        a.plot(xs, [s["point"]["step_s"] * 1e3 for s in pts], "o", label=f"measured, prompt {ctx}")
        fit = [_decode(df, s["point"]) * 1e3 for s in pts]
        a.plot(xs, fit, "--", lw=1, label=f"fit, prompt {ctx}")
    a.set(xlabel="concurrent streams (batch)", ylabel="decode step (ms)", title="decode step vs batch", xscale="log")
    batches = sorted({s["batch"] for s in d["decode"]})
    a.set_xticks(batches, [str(b) for b in batches])
    a.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    a.legend(fontsize=7)
    ts = [p["tokens"] for p in d["prefill"]]
    # the measured points placed on the fit at the shortest prompt: their differences are what was fitted
    anchor = _anchor(d)
    base = _prefill(fp, anchor["tokens"]) - anchor["ttft_s"]
    b.plot(ts, [(p["ttft_s"] + base) * 1e3 for p in d["prefill"]], "o", label=f"TTFT, anchored at {anchor['tokens']}")
    b.plot(ts, [_prefill(fp, x) * 1e3 for x in ts], "--", label="fit")
    srv = [(p["tokens"], p["server_prefill_ms"]) for p in d["prefill"] if p["server_prefill_ms"] is not None]
    if srv:
        b.plot(*zip(*srv), "x", label="server's own prefill")
    b.set(xlabel="prompt tokens", ylabel="prefill (ms)", title="prefill vs prompt length", xscale="log", yscale="log")
    b.set_xticks(ts, [str(x) for x in ts])
    b.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    b.legend(fontsize=7)
    st = d["tables"]["stalls"]
    labels = [f"b={s['batch']}\nT={s['prompt_tokens']}" for s in st]
    xs2 = range(len(st))
    c.bar([x - 0.2 for x in xs2], [s["measured_stall_ms"] or 0 for s in st], 0.4, label="measured stall")
    med = [s["predicted_stall_ms"] for s in st]
    p90 = [s.get("predicted_p90_ms", m) - m for s, m in zip(st, med)]
    c.bar([x + 0.2 for x in xs2], med, 0.4, yerr=[[0] * len(st), p90], capsize=3, label="predicted (median, p90)")
    c.set_xticks(list(xs2), labels, fontsize=7)
    c.set(ylabel="longest gap of the streams (ms)", title=f"the tax (chunking: {d['chunking']['verdict']})")
    c.legend(fontsize=7)
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    fig.suptitle(f"pdserve bench probe: {d['model']} at {d['base_url']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
