"""`pdserve cost`: the article's tables for any model, GPU, link and MFU (no torch).

With no arguments it prints the article's tables (Llama-3.1-70B FP8 on one H100 SXM, 40% MFU).
Beside the article's KV transfer table it predicts what streaming the KV layer by layer
(`pdserve serve --kv-transfer layerwise`) leaves after the prefill on each link, and the prompt
length from which `--kv-transfer auto` streams (costmodel/article/layerwise.py).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from cli import CliError
from cli.output import emit_json
from costmodel.article import cost_model as cm
from costmodel.article.layerwise import DEFAULT_GROUP_OVERHEAD_S, DEFAULT_OPEN_S, groups_of


def _ints(s: str) -> list[int]:
    try:
        vals = [int(x.replace("_", "")) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def _floats(s: str) -> list[float]:
    try:
        vals = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None
    if not vals or min(vals) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative numbers, got {s!r}")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default="llama-3.1-70b",
        help="model preset, checkpoint directory or config.json (default: llama-3.1-70b)",
    )
    p.add_argument("--hw", default="h100-sxm", help=f"GPU preset: {', '.join(sorted(cm.HARDWARE))}")
    p.add_argument("--mfu", type=float, default=None, help="model FLOP utilisation (default 0.4)")
    p.add_argument("--ctx", type=int, default=4096, help="decode context and the document prompt length (default 4096)")
    p.add_argument("--batch", type=int, default=32, help="decode batch for the token conversion and capacity")
    p.add_argument("--batches", type=_ints, default=[1, 8, 32, 64, 256, 512])
    p.add_argument("--contexts", type=_ints, default=[1024, 4096, 16384, 32768])
    p.add_argument("--chunks", type=_ints, default=[128, 512, 1024])
    p.add_argument("--rates", type=_floats, default=[0.25, 0.5, 1.0, 2.0], help="prefills/s, capacity table")
    p.add_argument(
        "--links", default="nvlink,ib-400g,ib-100g", help=f"comma-separated: {', '.join(cm.LINKS)} or NAME=GBPS"
    )
    p.add_argument(
        "--kv-stream-layers",
        type=int,
        default=1,
        metavar="N",
        help="layers per group when the KV streams layer by layer (as pdserve serve's flag): the "
        "transfer table's layer-wise column and auto threshold (default 1)",
    )
    p.add_argument(
        "--kv-group-overhead-ms",
        type=float,
        default=DEFAULT_GROUP_OVERHEAD_S * 1e3,
        metavar="MS",
        help="fixed cost of one layer-wise pull beyond its bytes (default: the 3.3 ms measured over TCP on "
        "the CPU cluster rehearsal; RDMA's is far smaller, so set yours)",
    )
    p.add_argument("--crossover-ctx", type=int, default=512, help="context of the crossover batch (default 512)")
    p.add_argument("--weight-dtype", default="fp8", choices=["fp8", "bf16", "fp16", "fp32"])
    p.add_argument("--kv-dtype", default="fp8", choices=["fp8", "bf16", "fp32"])
    p.add_argument(
        "--calibration", default=None, help="calibration JSON: measured bandwidth and MFU replace the datasheet"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def compute(args: argparse.Namespace) -> dict[str, Any]:
    try:
        model = cm.ModelSpec.resolve(args.config)
        hw = cm.resolve_hardware(args.hw)
        links = [cm.resolve_link(x.strip()) for x in args.links.split(",") if x.strip()]
        cal = cm.Calibration.load(args.calibration) if args.calibration else None
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise CliError(str(e)) from None
    if cal:
        hw = cal.apply(hw)
        links = [cal.link(link) for link in links]
    mfu = args.mfu if args.mfu is not None else (cal.effective_mfu(hw, cm.ARTICLE_MFU) if cal else cm.ARTICLE_MFU)
    if not 0 < mfu <= 1:
        raise CliError(f"--mfu must be in (0, 1], got {mfu}")
    if args.ctx < 1 or args.batch < 1 or args.kv_stream_layers < 1 or args.kv_group_overhead_ms < 0:
        raise CliError("--ctx, --batch and --kv-stream-layers must be positive")
    dt = dict(weight_dtype=args.weight_dtype)
    kdt = dict(dt, kv_dtype=args.kv_dtype)
    try:
        hw.peak(args.weight_dtype)
    except ValueError as e:
        raise CliError(f"{e}; pick another --weight-dtype") from None

    kvb = cm.kv_bytes_per_token(model, args.kv_dtype)
    decode = [cm.decode_step(model, hw, b, args.ctx, mfu, **kdt) for b in args.batches]
    pre = [cm.prefill(model, hw, t, mfu, **dt) for t in args.contexts]
    chunks = [cm.chunk_row(model, hw, c, 1, args.ctx, mfu, **kdt) for c in args.chunks]
    cap = cm.capacity_table(model, hw, args.rates, args.ctx, args.batch, args.ctx, mfu, **kdt)
    doc_bytes = kvb * args.ctx
    doc_prefill = cm.prefill(model, hw, args.ctx, mfu, **dt)
    step_b = cm.decode_step(model, hw, args.batch, args.ctx, mfu, **kdt)
    cross = cm.crossover_batch(model, hw, args.crossover_ctx, mfu, **kdt)
    return {
        "model": model.name,
        "hardware": hw.name,
        "hardware_source": hw.source,
        "mfu": mfu,
        "weight_dtype": args.weight_dtype,
        "kv_dtype": args.kv_dtype,
        "ctx": args.ctx,
        "batch": args.batch,
        "calibration": cal.to_dict() if cal else None,
        "kv_bytes_per_token": kvb,
        "params": model.params,
        "weight_bytes": cm.weight_bytes(model, args.weight_dtype),
        "prompt_kv_bytes": doc_bytes,
        "decode_table": [
            {
                "batch": d.batch,
                "step_ms": d.time_s * 1e3,
                "read_gb": d.read_bytes / cm.GB,
                "per_seq_tok_s": d.per_seq_tok_s,
                "tok_s": d.tok_s,
                "memory_ms": d.memory_s * 1e3,
                "flop_ms": d.flop_s * 1e3,
            }
            for d in decode
        ],
        "per_seq_kv_read_ms": args.ctx * kvb / hw.mem_bw * 1e3,
        "per_seq_flop_ms": 2 * model.params / (mfu * hw.peak(args.weight_dtype)) * 1e3,
        "crossover_ctx": args.crossover_ctx,
        "crossover_batch": None if math.isinf(cross) else cross,
        "prefill_table": [
            {
                "context": p.tokens,
                "linear_tflop": p.linear_flops / 1e12,
                "attention_tflop": p.attention_flops / 1e12,
                "attention_share": p.attention_share,
                "time_ms": p.time_s * 1e3,
            }
            for p in pre
        ],
        "batch_token_ms": step_b.time_s / args.batch * 1e3,
        "prefill_ms": doc_prefill.time_s * 1e3,
        "prefill_equivalent_tokens": cm.prefill_equivalent_tokens(
            model, hw, args.ctx, args.batch, args.ctx, mfu, **kdt
        ),
        "break_even_chunk_tokens": cm.break_even_chunk(model, hw, 1, args.ctx, mfu, **kdt),
        "chunk_table": [{"chunk": c.chunk, "time_ms": c.time_s * 1e3, "decode_steps": c.decode_steps} for c in chunks],
        "capacity_table": [
            {
                "prefills_per_s": r.prefills_per_s,
                "gpu_share": r.gpu_share,
                "decode_sequences": r.decode_sequences,
                "per_seq_tok_s": r.per_seq_tok_s if r.decode_sequences > 0 else None,
            }
            for r in cap
        ],
        "link_table": [
            {
                "link": link.name,
                "label": link.label,
                "gbytes_per_s": link.bw / cm.GB,
                "ms": cm.transfer_seconds(doc_bytes, link) * 1e3,
                "share_of_prefill": cm.transfer_seconds(doc_bytes, link) / doc_prefill.time_s,
                **_layerwise_row(model, hw, link, args, mfu),
            }
            for link in links
        ],
        "kv_stream_layers": args.kv_stream_layers,
        "kv_stream_groups": groups_of(model.num_layers, args.kv_stream_layers),
        "kv_group_overhead_ms": args.kv_group_overhead_ms,
        "kv_stream_open_ms": DEFAULT_OPEN_S * 1e3,
        "step_fit": _step_fit(cal, args),
    }


def _layerwise_row(
    model: cm.ModelSpec, hw: cm.HardwareSpec, link: cm.Link, args: argparse.Namespace, mfu: float
) -> dict[str, Any]:
    """Predicted: the document's KV left after its prefill when streamed, and the shortest prompt
    `--kv-transfer auto` streams on this link (None: no prompt up to ~1M tokens gains)."""
    layers, wdt, kdt, o = args.kv_stream_layers, args.weight_dtype, args.kv_dtype, args.kv_group_overhead_ms / 1e3
    exposed = cm.layerwise_kv_exposed_seconds(model, hw, args.ctx, link, layers, mfu, wdt, kdt, o)
    return {
        "layerwise_exposed_ms_predicted": exposed * 1e3,
        "auto_threshold_tokens": cm.layerwise_threshold(model, hw, link, layers, args.ctx, mfu, wdt, kdt, o),
    }


def _step_fit(cal: cm.Calibration | None, args: argparse.Namespace) -> dict[str, Any] | None:
    """The calibration's measured step-cost terms and what they price (the FLOP tables above
    stay the article's arithmetic on the calibrated spec)."""
    f = cal.fitted_steps() if cal else None
    if f is None:
        return None
    return {
        "terms": f.to_dict(),
        "formula": f.describe(),
        "source": cal.source if cal else "",
        "decode_ms": [{"batch": b, "ms": f.decode_seconds([args.ctx] * b) * 1e3} for b in args.batches],
        "prefill_ms": [{"context": t, "ms": f.prefill_seconds(t) * 1e3} for t in args.contexts],
        "chunk_ms": [{"chunk": c, "ms": f.prefill_seconds(c) * 1e3} for c in args.chunks],
    }


def _table(headers: list[str], rows: list[list[str]]) -> str:
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w[i]) for i, h in enumerate(headers))]
    lines += ["  ".join(c.rjust(w[i]) for i, c in enumerate(r)) for r in rows]
    return "\n".join(lines)


def _tokens(n: int | None) -> str:
    return "never" if n is None else f"{n:,} tokens"


def render(r: dict[str, Any]) -> str:
    ctx, b = r["ctx"], r["batch"]
    cross = r["crossover_batch"]
    out = [
        f"{r['model']} on {r['hardware']}, {r['mfu']:.0%} MFU, {r['weight_dtype']} weights, {r['kv_dtype']} KV",
        f"  params {r['params'] / 1e9:.2f} B, weights {r['weight_bytes'] / 1e9:.1f} GB, "
        f"KV {r['kv_bytes_per_token'] / 1024:g} KiB/token, "
        f"a {ctx:,}-token prompt's KV {r['prompt_kv_bytes'] / 1e6:.0f} MB",
        "",
        f"Decode step (memory floor vs FLOPs) @ {ctx:,} ctx",
        _table(
            ["batch", "step ms", "reads GB", "per-seq tok/s", "node tok/s"],
            [
                [
                    str(d["batch"]),
                    f"{d['step_ms']:.1f}",
                    f"{d['read_gb']:.0f}",
                    f"{d['per_seq_tok_s']:.1f}",
                    f"{d['tok_s']:,.0f}",
                ]
                for d in r["decode_table"]
            ],
        ),
        f"  each sequence adds {r['per_seq_kv_read_ms']:.2f} ms of KV read vs {r['per_seq_flop_ms']:.2f} ms of FLOPs; "
        + (
            f"compute-bound past batch {cross:.0f} at {r['crossover_ctx']}-token context"
            if cross is not None
            else f"never compute-bound at {r['crossover_ctx']}-token context"
        ),
        "",
        "Prefill",
        _table(
            ["context", "linear TFLOP", "attention TFLOP", "attn share", "time ms"],
            [
                [
                    f"{p['context']:,}",
                    f"{p['linear_tflop']:,.0f}",
                    f"{p['attention_tflop']:,.0f}",
                    f"{p['attention_share']:.0%}",
                    f"{p['time_ms']:,.0f}",
                ]
                for p in r["prefill_table"]
            ],
        ),
        "",
        f"One {ctx:,}-token prompt = {r['prefill_ms']:.0f} ms / ({r['batch_token_ms']:.2f} ms per token at batch {b})"
        f" = {r['prefill_equivalent_tokens']:.0f} generated tokens",
        f"Break-even chunk (prefill chunk = one batch-1 decode step): {r['break_even_chunk_tokens']:.0f} tokens",
        "",
        "Chunked prefill",
        _table(
            ["chunk", "time ms", "decode steps"],
            [[f"{c['chunk']:,}", f"{c['time_ms']:.0f}", f"{c['decode_steps']:.2f}"] for c in r["chunk_table"]],
        ),
        "",
        f"Capacity: {ctx:,}-token prefills mixed with batch-{b} decode",
        _table(
            ["prefills/s", "GPU on prefill", "decode seqs that fit", "per-seq tok/s"],
            [
                [
                    f"{c['prefills_per_s']:g}",
                    f"{c['gpu_share']:.0%}",
                    f"{c['decode_sequences']:.1f}",
                    "-" if c["per_seq_tok_s"] is None else f"{c['per_seq_tok_s']:.1f}",
                ]
                for c in r["capacity_table"]
            ],
        ),
        "",
        f"KV transfer of a {ctx:,}-token prompt ({r['prompt_kv_bytes'] / 1e6:.0f} MB): bulk after the prefill, "
        "and layer-wise (predicted) while it runs",
        _table(
            ["link", "GB/s", "ms", "% of prefill", "layer-wise ms left", "auto streams from"],
            [
                [
                    row["label"],
                    f"{row['gbytes_per_s']:g}",
                    f"{row['ms']:.1f}",
                    f"{row['share_of_prefill']:.1%}",
                    f"{row['layerwise_exposed_ms_predicted']:.1f}",
                    _tokens(row["auto_threshold_tokens"]),
                ]
                for row in r["link_table"]
            ],
        ),
        f"  layer-wise: {r['kv_stream_groups']} groups of {r['kv_stream_layers']} layers, "
        f"{r['kv_group_overhead_ms']:g} ms a group, {r['kv_stream_open_ms']:g} ms to open the stream "
        "(measured on the CPU VM); left = the last group's share, or the backlog when the link is "
        "slower than the prefill writes KV",
    ]
    sf = r.get("step_fit")
    if sf:
        t = sf["terms"]
        err = t.get("rms_rel_error")
        out += [
            "",
            f"Measured step cost (calibration step_fit, {t.get('samples', 0)} timed steps"
            + (f", rms error {100 * err:.1f}%" if err is not None else "")
            + f"; {sf['source']})",
            f"  step = {sf['formula']}",
            "  decode @ {:,} ctx: {}".format(
                ctx, ", ".join(f"batch {d['batch']} {d['ms']:.1f} ms" for d in sf["decode_ms"])
            ),
            "  prefill alone: " + ", ".join(f"{p['context']:,} tok {p['ms']:,.1f} ms" for p in sf["prefill_ms"]),
            "  first chunk alone: " + ", ".join(f"{c['chunk']:,} tok {c['ms']:.1f} ms" for c in sf["chunk_ms"]),
        ]
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    result = compute(args)
    if args.json:
        emit_json(result)
    else:
        print(render(result))
    return 0
