"""`pdserve bench chunks`: the article's open question, measured. What does a small prefill chunk
cost in prefill throughput, and what does each chunk size do to the decode streams' ITL?

With a decode batch running (`--decode-batch` sequences at `--context` tokens, KV pre-filled),
for each chunk size c the prompt (`--prompt-len` tokens) is prefilled in chunks of c:
  (a) alone: tokens/s and MFU of the chunked prefill with no decode running;
  (b) mixed: every step is the decode batch plus one chunk in the same forward (Sarathi-style),
      so its time is the ITL the decode streams see while the prompt is admitted; compared
      with the decode-only step;
  (c) break-even chunk: predicted by the cost model for this device (from the device spec, and
      calibrated from this run's measured decode step and prefill rate), and measured (the chunk
      whose time alone equals one decode step; the chunk where the mixed step reaches 2x).
The engine harness here (device, model, KV setup) is shared with `bench article`.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.engine import toolkit as eb
from benchmarks.engine.timing import measure, time_call
from cli import CliError
from cli.output import emit_json
from costmodel.article import cost_model as cm
from costmodel.fit.step_fit import StepCostFit, StepShape, fit
from costmodel.provenance import RESULTS_DIR, save_calibration, write_result
from engine.runner.model_runner import StepItem

CPU_DEFAULTS = dict(
    model="tiny", decode_batch=8, context=512, prompt_len=2048, chunks="16,32,64,128,256,512,1024,2048", repeats=3
)
GPU_DEFAULTS = dict(
    model=None, decode_batch=32, context=4096, prompt_len=4096, chunks="64,128,256,512,1024,2048,4096", repeats=2
)


@dataclass(frozen=True)
class ChunkPoint:
    chunk: int
    num_chunks: int
    prefill_s: float  # whole prompt in chunks of `chunk`, nothing else running (sum of step medians)
    prefill_tok_s: float
    chunk_ms: float  # mean time of one chunk alone (prefill_s / num_chunks)
    achieved_tflops: float  # article's FLOP count of the prompt / prefill_s
    mfu: float  # achieved / peak of the device spec
    mixed_mean_ms: float  # decode batch + one chunk per step: mean step = ITL while chunks run
    mixed_p50_ms: float
    mixed_max_ms: float
    mixed_prefill_s: float  # the prompt's prefill time with the decode batch riding along
    itl_ratio: float  # mixed_mean / decode-only step
    # each chunk alone, in prompt order (ms, median over the repeats): a chunk at a deep start
    # costs more than its pairs say (it re-reads its whole context's KV; costmodel/fit/step_fit.py)
    alone_ms: tuple[float, ...] = ()


def _crossing(xs: list[int], ys: list[float], target: float) -> float | None:
    """The x where y first reaches `target`, interpolated linearly in log2(x); None if never."""
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y >= target:
            if i == 0:
                return float(x) if y == target else None
            x0, y0 = xs[i - 1], ys[i - 1]
            f = (target - y0) / (y - y0)
            return 2 ** (math.log2(x0) + f * (math.log2(x) - math.log2(x0)))
    return None


def _fit_overhead(points: list[ChunkPoint], flops_per_chunk: list[float]) -> tuple[float, float]:
    """chunk_time = overhead + flops / rate over the sweep -> (overhead_s, rate FLOP/s).

    The overhead is the fixed cost of a step (launches, Python, small GEMMs); it is what makes
    small chunks lose throughput. First a least-squares line; if that is not physical (negative
    intercept, e.g. when attention at long chunks runs below the linear rate), the rate is the
    best the sweep achieved and the overhead what the smallest chunk takes beyond it."""
    xs, ys = flops_per_chunk, [p.chunk_ms / 1e3 for p in points]
    n = len(xs)
    if n >= 2:
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
        icpt = my - slope * mx
        if slope > 0 and icpt >= 0:
            return icpt, 1 / slope
    rate = max(x / y for x, y in zip(xs, ys))
    return max(0.0, ys[0] - xs[0] / rate), rate


def _fit_check(f: Any, points: list[ChunkPoint], P: int, B: int, C: int, decode_s: float) -> list[dict[str, Any]]:
    """The step-cost fit against this sweep's own headline figures (predicted, measured, error)."""
    whole = next((p for p in points if p.chunk == P), None)
    rows = [("decode step", f.decode_seconds([C] * B), decode_s)]
    for p in points:
        starts = range(0, P, p.chunk)
        alone = sum(f.seconds(StepShape.of((), [(s, min(p.chunk, P - s))])) for s in starts)
        rows.append((f"prefill in chunks of {p.chunk}", alone, p.prefill_s))
    if whole is not None:
        rows.append(
            (
                "whole prompt + decode batch (stall)",
                f.seconds(StepShape.of([C] * B, [(0, P)])),
                whole.mixed_max_ms / 1e3,
            )
        )
    return [
        {"figure": name, "predicted_ms": pr * 1e3, "measured_ms": me * 1e3, "error": (pr - me) / me}
        for name, pr, me in rows
    ]


def run_sweep(args: argparse.Namespace, h: eb.Harness, chunks: list[int]) -> dict[str, Any]:
    m = cm.ModelSpec.from_config(h.cfg)
    P, B, C = args.prompt_len, args.decode_batch, args.context
    decode = h.decode_batch(B, C, args.kv_fill, seed=args.seed)
    table = h.bm.allocate(h.bm.blocks_for(P))
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, h.cfg.vocab_size, (P,), generator=gen).tolist()

    def chunk_item(start: int, c: int) -> StepItem:
        n = min(c, P - start)
        return StepItem(prompt[start : start + n], start, table, want_logits=start + n == P)

    def decode_step() -> None:
        h.runner.forward(decode)

    # Warm-up: both kinds of step at the largest shape before anything is timed.
    h.runner.forward(decode + [chunk_item(0, max(chunks))])
    d = measure(decode_step, h.device, repeats=args.decode_repeats, warmup=2)
    # Every timed step also becomes a sample (shape, seconds) for the step-cost fit; a decode
    # step of one sequence separates the per-sequence term from the per-step one.
    d1 = measure(lambda: h.runner.forward(decode[:1]), h.device, repeats=max(3, args.decode_repeats // 2), warmup=1)
    decode_shape = StepShape.of([C] * B)
    samples: list[tuple[StepShape, float]] = [(decode_shape, d.median_s)] * 4 + [(StepShape.of([C]), d1.median_s)] * 2
    total = sum(-(-P // c) * args.repeats for c in chunks)
    bar = tqdm(total=total, desc="bench chunks", unit="step", file=sys.stderr, disable=args.no_progress)
    points, flops_chunk = [], []
    lin, att = cm.prefill_flops(m, P)
    for c in chunks:
        starts = list(range(0, P, c))
        h.runner.forward([chunk_item(0, c)])  # warm-up of this shape
        h.runner.forward(decode + [chunk_item(0, c)])
        # Alone and mixed interleaved step by step, so drifting machine load hits both alike;
        # each step's time is its median over the repeats.
        alone_runs, mixed_runs = [], []
        for _ in range(args.repeats):
            a, mx = [], []
            for s in starts:
                # the lambdas run here, in the iteration that builds them (pyproject: B023 off for benchmarks/)
                a.append(time_call(lambda: h.runner.forward([chunk_item(s, c)]), h.device))
                mx.append(time_call(lambda: h.runner.forward(decode + [chunk_item(s, c)]), h.device))
                bar.update(1)
            alone_runs.append(a)
            mixed_runs.append(mx)
        alone_steps = [statistics.median(col) for col in zip(*alone_runs)]
        mixed = [statistics.median(col) for col in zip(*mixed_runs)]
        for s, t_alone, t_mixed in zip(starts, alone_steps, mixed):
            n = min(c, P - s)
            samples.append((StepShape.of((), [(s, n)]), t_alone))
            samples.append((StepShape.of([C] * B, [(s, n)]), t_mixed))
        alone = sum(alone_steps)
        ms = sorted(mixed)
        tf = (lin + att) / alone / 1e12
        points.append(
            ChunkPoint(
                chunk=c,
                num_chunks=len(starts),
                prefill_s=alone,
                prefill_tok_s=P / alone,
                chunk_ms=alone / len(starts) * 1e3,
                achieved_tflops=tf,
                mfu=tf * 1e12 / h.peak_flops,
                mixed_mean_ms=sum(mixed) / len(mixed) * 1e3,
                mixed_p50_ms=ms[len(ms) // 2] * 1e3,
                mixed_max_ms=ms[-1] * 1e3,
                mixed_prefill_s=sum(mixed),
                itl_ratio=sum(mixed) / len(mixed) / d.median_s,
                alone_ms=tuple(round(t * 1e3, 3) for t in alone_steps),
            )
        )
        flops_chunk.append((lin + att) / len(starts))
    bar.close()

    step_ms = d.median_s * 1e3
    overhead_s, rate = _fit_overhead(points, flops_chunk)
    step_fit = fit(samples)
    spec = h.spec
    # The decode step the device spec predicts, before any calibrated overhead.
    raw = cm.decode_step(m, spec, B, C, args.mfu, h.compute_dtype, h.kv_dtype).time_s
    cal = cm.Calibration(
        device=h.device_name,
        dtype=h.compute_dtype,
        mem_bandwidth_gbps=h.probe.copy_gbps if h.spec_is_measured else None,
        peak_tflops=h.peak_flops / 1e12,
        achieved_tflops=rate / 1e12,
        decode_step_overhead_ms=max(0.0, d.median_s - raw) * 1e3,
        prefill_overhead_ms=overhead_s * 1e3,
        source=f"pdserve bench chunks ({h.cfg.name}, batch {B} @ {C} ctx, prompt {P})",
        step_fit=step_fit.to_dict(),
        torch_threads=torch.get_num_threads(),  # this process's, which timed every step above
    )
    hw_cal = cal.apply(spec)
    mfu_cal = cal.effective_mfu(hw_cal, args.mfu)
    xs = [p.chunk for p in points]
    break_even = {
        "predicted_spec": cm.break_even_chunk(m, spec, B, C, args.mfu, h.compute_dtype, h.kv_dtype),
        "predicted_spec_mfu": args.mfu,
        "predicted_calibrated": cm.break_even_chunk(m, hw_cal, B, C, mfu_cal, h.compute_dtype, h.kv_dtype),
        "measured_alone": _crossing(xs, [p.chunk_ms for p in points], step_ms),
        "measured_mixed_2x": _crossing(xs, [p.mixed_mean_ms for p in points], 2 * step_ms),
        "definitions": {
            "predicted_spec": "cost model on the device spec at the given MFU: chunk time = one decode step",
            "predicted_calibrated": "cost model calibrated with this run's decode step, prefill rate and "
            "per-chunk overhead (fit over the sweep): chunk time = one decode step",
            "measured_alone": "chunk whose mean time alone equals the measured decode-only step "
            "(log-interpolated; null if the sweep does not cross it)",
            "measured_mixed_2x": "chunk where the mixed step (decode batch + chunk) reaches 2x the "
            "decode-only step (log-interpolated; null if not crossed)",
        },
    }
    return {
        "model": h.cfg.name,
        "device": h.device_name,
        "compute_dtype": h.compute_dtype,
        "decode_batch": B,
        "context": C,
        "prompt_len": P,
        "decode_only_ms": {"median": step_ms, "min": d.min_s * 1e3, "max": d.max_s * 1e3, "repeats": d.repeats},
        "predicted_decode_ms": raw * 1e3,
        "points": [asdict(p) for p in points],
        "break_even_chunk": break_even,
        "prefill_fit": {"overhead_ms": overhead_s * 1e3, "tflops": rate / 1e12},
        "step_fit": step_fit.to_dict(),
        "step_fit_check": _fit_check(step_fit, points, P, B, C, d.median_s),
        "calibration": cal.to_dict(),
        **h.spec_record(),
    }


def render(r: dict[str, Any]) -> str:
    be = r["break_even_chunk"]
    head = ["chunk", "chunks", "prefill tok/s", "MFU %", "chunk ms", "mixed ITL ms", "max ITL ms", "ITL/decode"]
    rows = [
        [
            str(p["chunk"]),
            str(p["num_chunks"]),
            f"{p['prefill_tok_s']:,.0f}",
            f"{100 * p['mfu']:.1f}",
            f"{p['chunk_ms']:.2f}",
            f"{p['mixed_mean_ms']:.2f}",
            f"{p['mixed_max_ms']:.2f}",
            f"{p['itl_ratio']:.2f}x",
        ]
        for p in r["points"]
    ]

    def f(x: float | None) -> str:
        if x is None:
            return "not crossed in the sweep"
        return "none (the per-chunk overhead alone exceeds a decode step)" if x == 0 else f"{x:.0f} tokens"

    lines = [
        f"bench chunks: {r['model']} on {r['device']} ({r['compute_dtype']} compute), decode batch "
        f"{r['decode_batch']} @ {r['context']} ctx, prompt {r['prompt_len']} tokens",
        f"decode-only step: {r['decode_only_ms']['median']:.2f} ms measured, "
        f"{r['predicted_decode_ms']:.2f} ms predicted ({r['spec']['source_kind']} spec)",
        eb.table(head, rows),
        f"break-even chunk: predicted {f(be['predicted_spec'])} (spec, MFU {be['predicted_spec_mfu']}), "
        f"{f(be['predicted_calibrated'])} (calibrated); measured {f(be['measured_alone'])} (chunk alone = "
        f"one decode step), {f(be['measured_mixed_2x'])} (mixed step = 2x decode)",
        f"prefill fit: {r['prefill_fit']['overhead_ms']:.2f} ms per chunk + FLOPs at "
        f"{r['prefill_fit']['tflops'] * 1e3:.1f} GFLOP/s; spec: {r['spec']['source']}",
        f"step-cost fit ({r['step_fit']['samples']} timed steps, rms error "
        f"{100 * (r['step_fit']['rms_rel_error'] or 0):.1f}%): " + StepCostFit.from_dict(r["step_fit"]).describe(),
        eb.table(
            ["figure", "predicted ms", "measured ms", "error"],
            [
                [c["figure"], f"{c['predicted_ms']:.1f}", f"{c['measured_ms']:.1f}", f"{100 * c['error']:+.1f}%"]
                for c in r["step_fit_check"]
            ],
        ),
    ]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    xs = [p["chunk"] for p in r["points"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.plot(xs, [p["prefill_tok_s"] for p in r["points"]], "o-")
    a.set(
        xscale="log",
        xlabel="prefill chunk (tokens)",
        ylabel="prefill tokens/s (no decode running)",
        title="prefill throughput vs chunk size",
    )
    step = r["decode_only_ms"]["median"]
    b.plot(xs, [p["mixed_mean_ms"] for p in r["points"]], "o-", label="mixed step (mean ITL)")
    b.plot(xs, [p["mixed_max_ms"] for p in r["points"]], "x--", label="mixed step (max ITL)")
    b.axhline(step, color="k", lw=1, label=f"decode only {step:.1f} ms")
    b.axhline(2 * step, color="grey", lw=1, ls=":", label="2x decode")
    for key, style in (("predicted_calibrated", "r:"), ("measured_mixed_2x", "g:")):
        x = r["break_even_chunk"][key]
        if x:
            b.axvline(x, color=style[0], ls=":", lw=1, label=f"{key.replace('_', ' ')}: {x:.0f}")
    b.set(
        xscale="log",
        yscale="log",
        xlabel="prefill chunk (tokens)",
        ylabel="decode ITL (ms)",
        title=f"ITL of {r['decode_batch']} decode streams while chunks run",
    )
    b.legend(fontsize=7)
    for ax in (a, b):
        eb.swept_axis(ax, xs)
    eb.save_figure(fig, path, f"{r['model']} on {r['device']}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    eb.add_common_arguments(p)
    g = p.add_argument_group("sweep (defaults: CPU / CUDA)")
    g.add_argument("--decode-batch", type=int, default=None, help="decode streams running (8 / 32)")
    g.add_argument("--context", type=int, default=None, help="context of each decode stream (512 / 4096)")
    g.add_argument("--prompt-len", type=int, default=None, help="the prompt being prefilled (2048 / 4096)")
    g.add_argument("--chunks", default=None, help="chunk sizes (16..2048 / 64,128,...,4096)")
    g.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="passes over the prompt, alone and mixed; each step's time is its median (3 / 2)",
    )
    g.add_argument("--decode-repeats", type=int, default=20, help="timed decode-only steps (default 20)")
    p.add_argument(
        "--calibration-out",
        default=None,
        help="calibration JSON (cost model schema); default: <out-dir>/<out>.calibration.json",
    )


def main(args: argparse.Namespace) -> int:
    device = eb.resolve_device(args.device)
    dflt = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    for k, v in dflt.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    chunks = eb.parse_ints(args.chunks, "--chunks")
    for name in ("decode_batch", "context", "prompt_len", "repeats", "decode_repeats"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1")
    if max(chunks) > args.prompt_len:
        raise CliError(f"--chunks: {max(chunks)} is longer than --prompt-len {args.prompt_len}")
    kv_tokens = args.decode_batch * (args.context + 1) + args.prompt_len
    args.model = eb.default_model(args, device, kv_tokens)
    h = eb.Harness.build(
        args,
        device,
        kv_tokens=kv_tokens,
        max_pos=max(args.context + 1, args.prompt_len),
        pool_blocks=args.decode_batch + 1,
    )
    load0 = eb.load_average()
    r = run_sweep(args, h, chunks)
    r["load_average"] = {"start": load0, "end": eb.load_average(), "cores": os.cpu_count()}
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    name = args.out or f"chunks-{h.cfg.name}-{device.type}"
    files: dict[str, str] = {}
    if not args.no_plot:
        out_dir.mkdir(parents=True, exist_ok=True)
        plot(r, out_dir / f"{name}.png")
        files["plot"] = str(out_dir / f"{name}.png")
    cal_path = Path(args.calibration_out) if args.calibration_out else out_dir / f"{name}.calibration.json"
    cal_path = save_calibration(cm.Calibration.from_dict(r["calibration"]), cal_path)
    files["calibration"] = str(cal_path)
    r["files"] = files
    path = write_result(name, r, config=eb.config_record(args), out_dir=out_dir)
    if args.json:
        emit_json({**r, "result": str(path)})
    else:
        print(render(r))
        print(f"results: {path}" + "".join(f"\n{k}: {v}" for k, v in files.items()))
    return 0
