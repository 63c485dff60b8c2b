"""`pdserve bench probe`: the article's arithmetic, measured on any OpenAI-compatible server.

The server is a black box: only its HTTP API is used (benchmarks/probe/measure.py says what each
measurement sends). The cost model is fitted to what it answered (costmodel/fit/probe_fit.py), the
article's tables are printed for it, and four files are written under --out-dir: the result JSON
(with provenance), the same summary as Markdown, a plot, and a calibration file that
`pdserve simulate --calibration` and `pdserve bench compare --calibration` accept.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import random
import re
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import prompt_threads
from benchmarks.client.bench_serve import finite_json
from benchmarks.client.logged_step import steps_table
from benchmarks.client.step_log import StepLogRecorder
from benchmarks.pace import describe as describe_pace
from benchmarks.pace import machine_pace
from benchmarks.probe.client import ProbeClient, ProbeError
from benchmarks.probe.plan import ProbePlan
from benchmarks.probe.report import plot, render
from benchmarks.probe.run import ProbeResult, probe
from cli import CliError
from cli.output import emit_json
from costmodel.article import cost_model as cm
from costmodel.provenance import OUT_DIR_HELP, RESULTS_DIR, provenance, write_result
from costmodel.sim.stall_jitter import thinned


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ProbePlan()
    s = p.add_argument_group("server")
    s.add_argument("--base-url", required=True, help="OpenAI API base URL (/v1 is added if missing)")
    s.add_argument("--model", default=None, help="model name (default: the first listed by /v1/models)")
    s.add_argument("--api-key", default="EMPTY")
    s.add_argument(
        "--prompts",
        choices=["auto", "ids", "text"],
        default="auto",
        help="send prompts as token ids (exact lengths) or text; auto: ids, text if the server refuses them",
    )
    s.add_argument("--request-timeout-s", type=float, default=60.0, help="per request; a silent server fails the probe")
    g = p.add_argument_group("what to measure")
    g.add_argument(
        "--max-context", type=int, default=d.max_context, help="longest prompt probed (128 doubling up to it)"
    )
    g.add_argument(
        "--max-batch",
        type=int,
        default=d.max_batch,
        help="largest decode batch (1 doubling up to it at a short context; long contexts to 8)",
    )
    g.add_argument(
        "--quick", action="store_true", help="fewer points and repeats (batch <= 4): under a minute on pdserve tiny"
    )
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seeds the prompts' tokens (default: a new seed each run, so a rerun never hits the server's "
        "prefix cache with the last run's prompts; the result records it)",
    )
    g.add_argument(
        "--model-config",
        default=None,
        help="pdserve preset or config.json of the served model: adds bandwidth and TFLOP/s to the calibration "
        "(default: --model, when pdserve knows it)",
    )
    g.add_argument("--weight-dtype", default="fp8", help="the served weights' dtype, for the calibration's bandwidth")
    m = p.add_argument_group("the article mix whose stall is predicted (default: bench serve --workload article's)")
    m.add_argument("--mix-streams", type=int, default=d.mix_streams, help="chat streams decoding")
    m.add_argument(
        "--mix-context", type=int, default=d.mix_context, help="their context (tokens) when a document arrives"
    )
    m.add_argument("--mix-doc-tokens", type=int, default=d.mix_doc_tokens, help="the document's prompt tokens")
    m.add_argument(
        "--mix-docs",
        type=int,
        default=d.mix_docs,
        help="documents in the printed `bench serve` command that checks the prediction (a median and a p90 "
        "need several)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the result as one JSON document instead of the table")
    o.add_argument("--no-plot", action="store_true")
    o.add_argument("--out", default=None, help="result name under --out-dir (default: probe-<model>-<timestamp>)")
    o.add_argument("--out-dir", "--results-dir", dest="results_dir", metavar="DIR", default=None, help=OUT_DIR_HELP)


def calibration(
    r: ProbeResult,
    model_config: str | None,
    weight_dtype: str,
    prompt_speedup: dict[str, Any] | None = None,
    pace_gflops: float | None = None,
) -> dict[str, Any]:
    """The fit as a `pdserve.calibration/1` file. The step fit prices every step in the simulator
    and `bench compare`; bandwidth and TFLOP/s (what the datasheet model needs) are derived only
    when pdserve knows the served model's shapes, since from outside only seconds are visible.
    `prompt_speedup`: benchmarks/prompt_threads.py's ratio on this host, `pace_gflops` its pace
    (benchmarks/pace.py), when measured."""
    cal = cm.Calibration(
        device=f"{r.model} at {r.base_url} (probed)",
        dtype=weight_dtype,
        decode_step_overhead_ms=r.decode_fit.fixed_s * 1e3,
        prefill_overhead_ms=r.prefill_fit.fixed_s * 1e3,
        source=f"pdserve bench probe --base-url {r.base_url} (black box)",
        step_fit=r.step_fit.to_dict(),
        prompt_thread_speedup=prompt_speedup,
        pace_gflops=pace_gflops,
        largest_batch=r.plan.batches[-1],
        # each decode step's longest gap over its streams less their median pace (what a stall adds)
        step_scatter_ms=[v * 1e3 for v in thinned([x for d in r.decode for x in d.step_residuals_s])] or None,
    )
    try:
        spec = cm.ModelSpec.resolve(model_config or r.model)
    except (ValueError, KeyError, OSError):
        spec = None
    if spec is not None:
        t = r.plan.prefill_tokens[-1]  # the longest prompt: the prefill's FLOP rate, fixed costs least in it
        if r.prefill_fit.seconds(t) > 0:
            tflops = sum(cm.prefill_flops(spec, t)) / r.prefill_fit.seconds(t) / cm.TFLOP
            cal = replace(cal, achieved_tflops=tflops, peak_tflops=tflops)  # the peak is not visible from outside
        if r.decode_fit.fixed_s > 0:  # a small batch's step reads the weights once
            bw = cm.weight_bytes(spec, weight_dtype) / r.decode_fit.fixed_s / cm.GB
            cal = replace(cal, mem_bandwidth_gbps=bw)
    return cal.to_dict()


def _name(args: argparse.Namespace, model: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-") or "server"
    return args.out or f"probe-{safe}-{_dt.datetime.now():%Y%m%d_%H%M%S}"


def main(args: argparse.Namespace) -> int:
    plan = ProbePlan(
        args.max_context,
        args.max_batch,
        args.quick,
        mix_streams=args.mix_streams,
        mix_context=args.mix_context,
        mix_doc_tokens=args.mix_doc_tokens,
        mix_docs=args.mix_docs,
    )
    try:
        plan.validate()
        if args.request_timeout_s <= 0:
            raise ValueError("--request-timeout-s must be > 0")
    except ValueError as e:
        raise CliError(str(e)) from None
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    client = ProbeClient(
        args.base_url, args.model, args.api_key, args.prompts, request_timeout_s=args.request_timeout_s, seed=seed
    )

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    async def run() -> ProbeResult:
        try:
            return await probe(client, plan, log, seed)
        finally:
            await client.close()

    start = time.perf_counter()
    # a pdserve server on this host: its own step log too, kept beside the fit (nothing in the fit is
    # read from it) so that `plan --verify` can read a candidate's pace against the probed server's
    # steps (benchmarks/plan_calibration.py); another server answers no steps and the probe goes on
    here = prompt_threads.on_this_host(args.base_url)
    root = args.base_url.rstrip("/").removesuffix("/v1")
    recorder = StepLogRecorder(root, args.api_key if args.api_key != "EMPTY" else None) if here else nullcontext()
    try:
        with recorder:
            result = asyncio.run(run())
    except (ProbeError, ValueError) as e:
        raise CliError(str(e)) from None
    steps = recorder.steps if isinstance(recorder, StepLogRecorder) else []
    # this host's pace, right after the probe's steps (a server here only), so that `plan --verify`
    # can tell a slower machine from a wrong price; and what a second prompt thread gives here
    pace = machine_pace() if here else None
    if pace:
        log(f"probe: this host's {describe_pace(pace)}")
    model = args.model_config or result.model
    speedup = prompt_threads.for_probe(args.base_url, model, lambda m: log(f"probe: {m}"))
    result.wall_s = time.perf_counter() - start
    server_steps = steps_table(steps) if steps else None
    payload = finite_json({**result.to_dict(), "prompt_thread_speedup": speedup, "server_steps": server_steps})
    name = _name(args, result.model)
    out_dir = Path(args.results_dir) if args.results_dir else RESULTS_DIR
    config = {**{k: v for k, v in vars(args).items() if not k.startswith("_")}, "seed": seed}
    path = write_result(name, payload, config, out_dir)
    text = render(payload)
    (out_dir / f"{name}.md").write_text(render(payload, md=True) + "\n")
    cal_path = out_dir / f"{name}.calibration.json"
    pace_gflops = pace["gemm_gflops_1thread"] if pace else None
    cal = calibration(result, args.model_config, args.weight_dtype, speedup, pace_gflops)
    cal_path.write_text(json.dumps({**cal, "provenance": provenance(config)}, indent=2) + "\n")
    files = {"result": str(path), "markdown": str(out_dir / f"{name}.md"), "calibration": str(cal_path)}
    if not args.no_plot:
        plot(payload, out_dir / f"{name}.png")
        files["plot"] = str(out_dir / f"{name}.png")
    if args.json:
        emit_json({"files": files, **payload})
    else:
        print(text)
        print("\n".join(f"{k}: {v}" for k, v in files.items()))
    return 0
