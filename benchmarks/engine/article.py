"""`pdserve bench article`: the article's decode-step and prefill tables, measured on this device,
beside the cost model's prediction for the same model and device.

- decode: one step of `b` sequences at `--ctx` context each (KV pre-filled), for each batch b;
- prefill: one whole prompt of T tokens in one forward, for each context T.

The prediction uses the device's datasheet on a known GPU (`--hardware` to choose) or, on a CPU
(no datasheet), the memory bandwidth and GEMM rate measured at the start of this same run; the
result says which. On a CPU the engine multiplies in fp32 from a dequantized copy of the weights,
so the prediction reads 4-byte weights and uses the fp32 GEMM rate as the peak.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.engine import toolkit as eb
from cli import CliError
from cli.output import emit_json
from costmodel.article import cost_model as cm
from costmodel.provenance import RESULTS_DIR, write_result
from engine.runner.model_runner import StepItem

CPU_DEFAULTS = dict(
    model="tiny", batches="1,8,32,64,256", ctx=256, contexts="256,512,1024,2048", decode_repeats=10, prefill_repeats=3
)
GPU_DEFAULTS = dict(
    model=None,
    batches="1,8,32,64,256",
    ctx=4096,
    contexts="1024,4096,16384,32768",
    decode_repeats=10,
    prefill_repeats=2,
)


@dataclass(frozen=True)
class Row:
    kind: str  # "decode" | "prefill"
    batch: int
    ctx: int
    measured_ms: float | None  # None: skipped (see note)
    predicted_ms: float
    error_pct: float | None  # (predicted - measured) / measured
    achieved: float | None  # decode: GB/s of the model's read bytes; prefill: TFLOP/s
    bound: str  # decode: memory | compute (predicted); prefill: attention share
    note: str = ""


def _err(pred: float, meas: float | None) -> float | None:
    return None if meas is None else 100 * (pred - meas) / meas


def run(
    args: argparse.Namespace, h: eb.Harness, batches: list[int], contexts: list[int], max_batch: int
) -> dict[str, Any]:
    m = cm.ModelSpec.from_config(h.cfg)
    spec, mfu, cdt, kvd = h.spec, args.mfu, h.compute_dtype, h.kv_dtype
    if args.calibration:
        try:
            cal = cm.Calibration.load(args.calibration)
        except ValueError as e:
            raise CliError(str(e)) from None
        spec = cal.apply(spec)
        mfu = cal.effective_mfu(spec, mfu)
    bar = tqdm(
        total=len(batches) + len(contexts), desc="bench article", unit="row", file=sys.stderr, disable=args.no_progress
    )
    rows: list[Row] = []
    decode = h.decode_batch(max_batch, args.ctx, args.kv_fill, seed=args.seed) if max_batch else []
    for b in batches:
        p = cm.decode_step(m, spec, b, args.ctx, mfu, cdt, kvd)
        bound = "memory" if p.memory_s >= p.flop_s else "compute"
        if b > max_batch:
            rows.append(
                Row(
                    "decode",
                    b,
                    args.ctx,
                    None,
                    p.time_s * 1e3,
                    None,
                    None,
                    bound,
                    "skipped: KV pool does not fit in device memory",
                )
            )
        else:
            meas = _timed(lambda: h.runner.forward(decode[:b]), h, args.decode_repeats)
            rows.append(
                Row(
                    "decode",
                    b,
                    args.ctx,
                    meas and meas * 1e3,
                    p.time_s * 1e3,
                    _err(p.time_s * 1e3, meas and meas * 1e3),
                    meas and p.read_bytes / meas / 1e9,
                    bound,
                    "" if meas else "skipped: out of memory",
                )
            )
        bar.update(1)
    gen = torch.Generator().manual_seed(args.seed + 1)
    table = h.bm.allocate(h.bm.blocks_for(max(contexts)))
    for t in contexts:
        pp = cm.prefill(m, spec, t, mfu, cdt)
        ids = torch.randint(0, h.cfg.vocab_size, (t,), generator=gen).tolist()
        meas = _timed(lambda: h.runner.forward([StepItem(ids, 0, table)]), h, args.prefill_repeats)
        rows.append(
            Row(
                "prefill",
                1,
                t,
                meas and meas * 1e3,
                pp.time_s * 1e3,
                _err(pp.time_s * 1e3, meas and meas * 1e3),
                meas and (pp.linear_flops + pp.attention_flops) / meas / 1e12,
                f"attention {100 * pp.attention_share:.0f}%",
                "" if meas else "skipped: out of memory",
            )
        )
        bar.update(1)
    bar.close()
    return {
        "model": h.cfg.name,
        "device": h.device_name,
        "compute_dtype": cdt,
        "kv_dtype": kvd,
        "ctx": args.ctx,
        "mfu": mfu,
        "peak_tflops": spec.peak(cdt) / 1e12,
        "rows": [asdict(r) for r in rows],
        **h.spec_record(),
        "prediction_spec": {
            "name": spec.name,
            "mem_bw_gbps": spec.mem_bw / 1e9,
            "peak_tflops": spec.peak(cdt) / 1e12,
            "step_overhead_ms": spec.step_overhead_s * 1e3,
            "prefill_overhead_ms": spec.prefill_overhead_s * 1e3,
            "source": spec.source,
        },
        "calibration_file": args.calibration,
    }


def _timed(fn: Any, h: eb.Harness, repeats: int) -> float | None:
    """Median seconds of `fn`, or None if the device ran out of memory (the row is then skipped)."""
    try:
        return eb.measure(fn, h.device, repeats=repeats, warmup=1).median_s
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def render(r: dict[str, Any]) -> str:
    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    dec = [x for x in r["rows"] if x["kind"] == "decode"]
    pre = [x for x in r["rows"] if x["kind"] == "prefill"]
    ps = r["prediction_spec"]
    kind = f"calibrated ({r['calibration_file']})" if r["calibration_file"] else r["spec"]["source_kind"]
    out = [
        f"bench article: {r['model']} on {r['device']} ({r['compute_dtype']} compute, {r['kv_dtype']} KV)",
        f"predictions: cost model at MFU {r['mfu']:.2f}, {kind} spec: {ps['mem_bw_gbps']:.1f} GB/s, "
        f"{ps['peak_tflops'] * 1e3:,.1f} GFLOP/s peak, overheads {ps['step_overhead_ms']:.2f} ms/step "
        f"{ps['prefill_overhead_ms']:.2f} ms/prefill",
        f"spec source: {ps['source']}",
        "",
        f"decode step @ {r['ctx']} ctx",
    ]
    out.append(
        eb.table(
            ["batch", "measured ms", "predicted ms", "error %", "achieved GB/s", "bound", "note"],
            [
                [
                    str(x["batch"]),
                    f(x["measured_ms"], ".2f"),
                    f(x["predicted_ms"], ".2f"),
                    f(x["error_pct"], "+.0f"),
                    f(x["achieved"], ".2f"),
                    x["bound"],
                    x["note"],
                ]
                for x in dec
            ],
        )
    )
    out += ["", "prefill (one prompt, one forward)"]
    out.append(
        eb.table(
            ["context", "measured ms", "predicted ms", "error %", "TFLOP/s", "MFU %", "share", "note"],
            [
                [
                    str(x["ctx"]),
                    f(x["measured_ms"], ".2f"),
                    f(x["predicted_ms"], ".2f"),
                    f(x["error_pct"], "+.0f"),
                    f(x["achieved"], ".4f"),
                    f(x["achieved"] and 100 * x["achieved"] / r["peak_tflops"], ".1f"),
                    x["bound"],
                    x["note"],
                ]
                for x in pre
            ],
        )
    )
    return "\n".join(out)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, kind, key, xlabel in (
        (axes[0], "decode", "batch", f"decode batch (@ {r['ctx']} ctx)"),
        (axes[1], "prefill", "ctx", "prompt length (tokens)"),
    ):
        rows = [x for x in r["rows"] if x["kind"] == kind]
        meas = [x for x in rows if x["measured_ms"] is not None]
        ax.plot([x[key] for x in meas], [x["measured_ms"] for x in meas], "o-", label="measured")
        ax.plot([x[key] for x in rows], [x["predicted_ms"] for x in rows], "s--", label="cost model")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel=xlabel,
            ylabel="ms",
            title=f"{kind} {'step' if kind == 'decode' else 'time'}",
        )
        eb.swept_axis(ax, [x[key] for x in rows])
        ax.legend(fontsize=8)
    kind = "calibrated" if r["calibration_file"] else r["spec"]["source_kind"]
    eb.save_figure(fig, path, f"{r['model']} on {r['device']}; prediction: {kind} spec, MFU {r['mfu']:.2f}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    eb.add_common_arguments(p)
    g = p.add_argument_group("tables (defaults: CPU / CUDA)")
    g.add_argument("--batches", default=None, help="decode batches (1,8,32,64,256)")
    g.add_argument("--ctx", type=int, default=None, help="context of every decode sequence (256 / 4096)")
    g.add_argument("--contexts", default=None, help="prefill prompt lengths (256..2048 / 1024,4096,16384,32768)")
    g.add_argument("--decode-repeats", type=int, default=None, help="timed steps per batch (10)")
    g.add_argument("--prefill-repeats", type=int, default=None, help="timed prefills per context (3 / 2)")
    p.add_argument(
        "--calibration",
        default=None,
        help="calibration JSON applied to the prediction's spec (e.g. from `bench chunks` or `bench gpu`)",
    )


def main(args: argparse.Namespace) -> int:
    device = eb.resolve_device(args.device)
    for k, v in (GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    batches, contexts = eb.parse_ints(args.batches, "--batches"), eb.parse_ints(args.contexts, "--contexts")
    for name in ("ctx", "decode_repeats", "prefill_repeats"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1")
    seq_tokens = -(-(args.ctx + 1) // 16) * 16  # one decode sequence's blocks, in tokens
    max_batch = max(batches)
    args.model = eb.default_model(args, device, min(max_batch, 32) * seq_tokens + max(contexts))
    if device.type == "cuda":  # as many decode sequences as fit next to the weights and the prompt
        from engine.config import resolve_model_config  # noqa: PLC0415
        from engine.generate_cli import kv_dtype_of  # noqa: PLC0415

        cfg = resolve_model_config(args.model)
        kvd = kv_dtype_of(args)
        budget = eb.cuda_kv_budget(cfg, args.dtype, device) - eb.kv_pool_bytes(cfg, kvd, max(contexts))
        max_batch = max(0, min(max_batch, int(budget // eb.kv_pool_bytes(cfg, kvd, seq_tokens))))
    h = eb.Harness.build(
        args,
        device,
        kv_tokens=max_batch * seq_tokens + max(contexts),
        max_pos=max(args.ctx + 1, max(contexts)),
        pool_blocks=1,
    )
    load0 = eb.load_average()
    r = run(args, h, batches, contexts, max_batch)
    r["load_average"] = {"start": load0, "end": eb.load_average(), "cores": os.cpu_count()}
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    name = args.out or f"article-{h.cfg.name}-{device.type}"
    if not args.no_plot:
        out_dir.mkdir(parents=True, exist_ok=True)
        plot(r, out_dir / f"{name}.png")
        r["files"] = {"plot": str(out_dir / f"{name}.png")}
    path = write_result(name, r, config=eb.config_record(args), out_dir=out_dir)
    if args.json:
        emit_json({**r, "result": str(path)})
    else:
        print(render(r))
        print(f"results: {path}" + "".join(f"\n{k}: {v}" for k, v in r.get("files", {}).items()))
    return 0
