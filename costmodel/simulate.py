"""`pdserve simulate`: colocated vs chunked vs disaggregated serving, simulated from the cost model.

Default scenario is the article's: Llama-3.1-70B FP8 on H100 SXM at 40% MFU, 32 chat streams
(closed loop), 4k-token documents arriving as a Poisson process. Every number it prints is
*simulated*; `--calibration` swaps the datasheet for measured bandwidth/MFU/overheads.
`--kv-transfer layerwise` streams the disaggregated KV while the prefill runs (only what the link
has not caught up with is left before the second token; costmodel/article/layerwise.py).
`--capacity` runs the article's capacity table through the simulator, beside the closed form.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cli import CliError
from cli.output import emit_json
from costmodel.article import cost_model as cm
from costmodel.provenance import OUT_DIR_HELP, RESULTS_DIR, write_result
from costmodel.sim.capacity import capacity_special_case
from costmodel.sim.engine import MODES, SimConfig, StepModel, Workload, simulate
from costmodel.sim.plot import plot_timelines
from costmodel.sim.summary import summarize

# ----------------------------------------------------------------------------- metrics


# ----------------------------------------------------------------------------- CLI


def _range(s: str) -> tuple[int, int]:
    try:
        lo, _, hi = s.partition(":")
        out = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI, got {s!r}") from None
    if not 1 <= out[0] <= out[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {s!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and hardware")
    g.add_argument("--config", default="llama-3.1-70b", help="model preset, checkpoint dir or config.json")
    g.add_argument("--hw", default="h100-sxm", help=f"GPU preset: {', '.join(sorted(cm.HARDWARE))}")
    g.add_argument("--mfu", type=float, default=None, help="default 0.4, or the calibration's")
    g.add_argument(
        "--calibration",
        default=None,
        help="calibration JSON from `pdserve bench chunks` or `bench probe` (format: costmodel/fit/calibration.py)",
    )
    g.add_argument(
        "--fixed-ctx",
        type=int,
        default=None,
        help="price every decode sequence at this context (the article's 4k assumption)",
    )
    g = p.add_argument_group("serving")
    g.add_argument(
        "--modes",
        default="colocated,chunked,disagg",
        help=f"comma-separated: {', '.join(MODES)} (auto: the disagg pools, each request prefilled remotely or in "
        "--chunk chunks on its decode worker, decided under --slo-ttft-ms and --slo-itl-ms as the router does)",
    )
    g.add_argument("--workers", type=int, default=1, help="colocated workers")
    g.add_argument("--prefill-workers", type=int, default=1)
    g.add_argument("--decode-workers", type=int, default=1)
    g.add_argument("--chunk", type=int, default=512, help="prompt tokens per step, chunked mode")
    g.add_argument("--max-batch", type=int, default=256)
    g.add_argument("--link", default="nvlink", help=f"{', '.join(cm.LINKS)} or NAME=GBPS")
    g.add_argument(
        "--kv-transfer",
        default="bulk",
        choices=("bulk", "layerwise"),
        help="disagg: how the KV crosses the link (as pdserve serve's flag). bulk: whole, after the "
        "prefill, so all of it sits between the first and second token; layerwise: each group of "
        "layers while the prompt still prefills, so only the last group's share (plus the backlog "
        "of a link slower than the prefill) is left (default: bulk)",
    )
    g.add_argument(
        "--kv-stream-layers",
        type=int,
        default=1,
        metavar="N",
        help="layers per streamed group under --kv-transfer layerwise: fewer leave less after the "
        "prefill, more pay fewer per-group overheads (default: 1)",
    )
    g = p.add_argument_group("workload")
    g.add_argument("--streams", type=int, default=32, help="closed-loop chat streams (0: use --chat-rate)")
    g.add_argument("--chat-rate", type=float, default=0.0, help="Poisson chat arrivals per second")
    g.add_argument("--chat-prompt", type=_range, default=(64, 512), metavar="LO:HI")
    g.add_argument("--chat-output", type=_range, default=(128, 1024), metavar="LO:HI")
    g.add_argument("--doc-rate", type=float, default=0.25, help="Poisson document arrivals per second")
    g.add_argument("--doc-prompt", type=_range, default=(4096, 4096), metavar="LO:HI")
    g.add_argument("--doc-output", type=_range, default=(128, 128), metavar="LO:HI")
    g.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    g.add_argument("--warmup", type=float, default=5.0, help="seconds excluded from the metrics")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("SLO (goodput)")
    g.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    g.add_argument("--slo-tpot-ms", type=float, default=50.0)
    g.add_argument("--slo-itl-ms", type=float, default=None, help="also bound every gap between tokens")
    g = p.add_argument_group("output")
    g.add_argument("--capacity", action="store_true", help="the article's capacity table, simulated vs closed form")
    g.add_argument("--rates", default="0.25,0.5,1,2", help="prefills/s for --capacity")
    g.add_argument("--json", action="store_true", help="print the result JSON instead of the table")
    g.add_argument("--png", default=None, help="timeline plot path (default: results/<name>.png)")
    g.add_argument("--no-png", action="store_true")
    g.add_argument("--name", default="simulate", help="result file name under --out-dir")
    g.add_argument(
        "--out-dir",
        default=None,
        help=OUT_DIR_HELP,
    )


def _steps(args: argparse.Namespace) -> tuple[StepModel, cm.Link, cm.Calibration | None]:
    try:
        model = cm.ModelSpec.resolve(args.config)
        hw = cm.resolve_hardware(args.hw)
        link = cm.resolve_link(args.link)
        cal = cm.Calibration.load(args.calibration) if args.calibration else None
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise CliError(str(e)) from None
    if cal:
        hw, link = cal.apply(hw), cal.link(link)
    mfu = args.mfu if args.mfu is not None else (cal.effective_mfu(hw, cm.ARTICLE_MFU) if cal else cm.ARTICLE_MFU)
    if not 0 < mfu <= 1:
        raise CliError(f"--mfu must be in (0, 1], got {mfu}")
    return StepModel(model, hw, mfu, fixed_ctx=args.fixed_ctx), link, cal


def _fmt(x: float | None, f: str = ".0f") -> str:
    return "-" if x is None else format(x, f)


def render(results: list[dict[str, Any]]) -> str:
    head = ["mode", "GPUs", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p99", "max stall", "tok/s", "goodput"]
    rows = [
        [
            r["label"],
            str(r["gpus"]),
            _fmt(r["ttft_ms"]["p50"]),
            _fmt(r["ttft_ms"]["p99"]),
            _fmt(r["tpot_ms"]["p50"], ".1f"),
            _fmt(r["tpot_ms"]["p99"], ".1f"),
            _fmt(r["itl_ms"]["p99"], ".1f"),
            _fmt(r["max_stall_ms"]),
            f"{r['throughput_tok_s']:,.0f}",
            f"{r['goodput_req_s']:.2f}",
        ]
        for r in results
    ]
    w = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
    lines = [
        "  ".join(h.rjust(w[i]) for i, h in enumerate(head)),
        "  ".join(("(ms)" if 2 <= i <= 7 else "(req/s)" if i == 9 else "").rjust(w[i]) for i in range(len(head))),
    ]
    lines += ["  ".join(c.rjust(w[i]) for i, c in enumerate(x)) for x in rows]
    return "\n".join(lines)


def render_kv(results: list[dict[str, Any]]) -> list[str]:
    """One line per disaggregated result: the KV crossing left after the prefill, and when the
    documents' second token came."""
    lines = []
    for r in results:
        kv = r.get("kv_exposed_ms") or {}
        if r.get("kv_transfer") is None or kv.get("p50") is None:
            continue
        how = "bulk" if r["kv_transfer"] == "bulk" else f"{r['kv_transfer']}, {r['kv_stream_layers']} layers a group"
        lines.append(
            f"{r['label']}: KV left after the prefill ({how}) p50 {kv['p50']:.1f} ms, p99 {kv['p99']:.1f} ms; "
            f"documents' 2nd token p50 {_fmt(r['ttst_doc_ms']['p50'])} ms after arrival"
        )
    return lines


def render_capacity(rows: list[dict[str, Any]]) -> str:
    lines = ["prefills/s  GPU on prefill (sim / closed)  decode seqs (sim / closed)"]
    for r in rows:
        lines.append(
            f"{r['prefills_per_s']:>10g}  {r['gpu_share']:>14.1%} / {r['closed_form_gpu_share']:<6.1%}"
            f"       {r['decode_sequences']:>8.2f} / {r['closed_form_decode_sequences']:.2f}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    steps, link, cal = _steps(args)
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    config.update(model=steps.model.name, hardware=steps.hw.name, mfu=steps.mfu, link_gbytes_per_s=link.bw / cm.GB)
    # the step prices are the calibration's: so is the thread count they were measured with
    config.update(calibration_torch_threads=cal.torch_threads if cal else None)
    if args.capacity:
        try:
            rates = [float(x) for x in args.rates.split(",")]
        except ValueError:
            raise CliError(f"--rates must be comma-separated numbers, got {args.rates!r}") from None
        fixed = StepModel(steps.model, steps.hw, steps.mfu, fixed_ctx=args.fixed_ctx or args.doc_prompt[0])
        rows = capacity_special_case(fixed, rates, prompt=args.doc_prompt[0], batch=args.streams or 32)
        path = write_result(args.name, {"simulated": True, "capacity_table": rows}, config, out_dir)
        if args.json:
            emit_json(rows)
        else:
            print(render_capacity(rows))
            print(f"(simulated; result: {path})")
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.warmup >= args.duration:
        raise CliError("--warmup must be shorter than --duration")
    try:
        wl = Workload(
            args.streams,
            args.chat_rate,
            args.chat_prompt,
            args.chat_output,
            args.doc_rate,
            args.doc_prompt,
            args.doc_output,
            args.duration,
            seed=args.seed,
        )
        cfgs = [
            SimConfig(
                m,
                args.workers,
                args.prefill_workers,
                args.decode_workers,
                args.chunk,
                args.max_batch,
                link,
                kv_transfer=args.kv_transfer,
                kv_stream_layers=args.kv_stream_layers,
                # auto decides each request under the SLOs (as `pdserve serve --mode auto` does)
                slo_ttft_s=args.slo_ttft_ms / 1e3 if args.slo_ttft_ms else None,
                slo_itl_s=args.slo_itl_ms / 1e3 if args.slo_itl_ms else None,
            )
            for m in modes
        ]
    except ValueError as e:
        raise CliError(str(e)) from None
    slo = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "itl_ms": args.slo_itl_ms}
    sims = [simulate(c, steps, wl) for c in cfgs]
    results = [summarize(s, args.warmup, slo) for s in sims]
    payload: dict[str, Any] = {"simulated": True, "slo": slo, "results": results}
    if not args.no_png:
        png = Path(args.png) if args.png else out_dir / f"{args.name}.png"
        payload["png"] = str(plot_timelines(sims, png, args.warmup))
    path = write_result(args.name, payload, config, out_dir)
    if args.json:
        emit_json(payload)
    else:
        print(
            f"simulated: {steps.model.name} on {steps.hw.name} at {steps.mfu:.0%} MFU; {args.streams} streams, "
            f"documents {args.doc_prompt[0]:,} tokens at {args.doc_rate:g}/s for {args.duration:g} s"
        )
        print(render(results))
        for line in render_kv(results):
            print(line)
        if cal is not None:
            threads = f"{cal.torch_threads} intra-op torch threads" if cal.torch_threads else "threads not recorded"
            print(f"calibration {args.calibration}: measured with {threads} per worker")
        print(f"result: {path}" + (f", plot: {payload['png']}" if "png" in payload else ""))
    return 0
