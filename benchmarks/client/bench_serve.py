"""`pdserve bench serve`: load an OpenAI-compatible server with a seeded workload and report
TTFT/TPOT/ITL/E2E, throughput, goodput and the article's stall metric.

In-process use (`bench compare`): `result = await run_benchmark(BenchConfig(...))`, then
`result.metrics` (a ServeMetrics) and `result.records` (one RequestRecord per request).
Metric formulas: see costmodel/serve_metrics.py.

Prompts are fresh on every run (a seed drawn at random and recorded in the result) unless
`--seed` pins them: a server with a prefix cache would serve a repeated run's documents from it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.client.multiturn import MultiTurnWorkload, NoTimeline, run_chats, summarize, table
from benchmarks.client.serve_client import (
    ClientConfig,
    ClientError,
    StreamRecord,
    normalize_base_url,
    run_requests,
    shape_counts,
    shape_warning,
)
from cli import CliError
from cli.output import emit_json
from costmodel.provenance import OUT_DIR_HELP, write_result
from costmodel.serve_metrics import Dist, RequestRecord, ServeMetrics, compute_metrics
from costmodel.workloads import RequestSpec, WorkloadConfig, build_workload


@dataclass(frozen=True)
class BenchConfig:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None


@dataclass
class BenchResult:
    config: BenchConfig
    model: str
    records: list[RequestRecord]
    metrics: ServeMetrics
    wall_s: float  # client wall time including model discovery

    def to_dict(self, include_records: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "wall_s": self.wall_s,
            "config": asdict(self.config),
            "metrics": asdict(self.metrics),
        }
        shapes = shape_counts(self.records)
        if shapes:  # {code: streams}: serve_client.SHAPE_NOTES says what each means
            out["stream_shape"] = shapes
        if include_records:
            out["records"] = [asdict(r) for r in self.records]
        return finite_json(out)


def finite_json(x: Any) -> Any:
    """JSON has no Infinity/NaN: write them as strings ("inf") so any parser can read the file."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_json(v) for v in x]
    return x


async def run_benchmark(config: BenchConfig, specs: list[RequestSpec] | None = None) -> BenchResult:
    """Build the workload (unless given), run it against the server, compute the metrics."""
    specs = build_workload(config.workload) if specs is None else specs
    start = time.perf_counter()
    model, records = await run_requests(specs, config.client)
    wall = time.perf_counter() - start
    metrics = compute_metrics(records, config.slo_ttft_ms, config.slo_tpot_ms)
    return BenchResult(config, model, records, metrics, wall)


# ----------------------------------------------------------------------------- prefix cache


def cached_tokens(records: list[RequestRecord]) -> tuple[int, int] | None:
    """(prompt tokens the server served from its cache, prompt tokens) over the requests where it
    said (usage.prompt_tokens_details.cached_tokens); None where it never did."""
    told = [r for r in records if isinstance(r, StreamRecord) and r.cached_tokens is not None]
    if not told:
        return None
    return sum(r.cached_tokens or 0 for r in told), sum(r.n_in for r in told)


def cached_documents_warning(records: list[RequestRecord]) -> str | None:
    """One line when a measured document's prompt came (partly) from the server's cache: its TTFT
    and the stall it causes are then not a fresh prefill's."""
    hit = [r for r in records if r.kind == "document" and isinstance(r, StreamRecord) and r.cached_tokens]
    if not hit:
        return None
    docs = sum(r.kind == "document" for r in records)
    each = ", ".join(f"{r.request_id} {r.cached_tokens}/{r.n_in}" for r in hit[:4]) + (", ..." if len(hit) > 4 else "")
    return (
        f"{len(hit)}/{docs} documents were served partly from the server's prefix cache (cached/prompt "
        f"tokens: {each}): their TTFT and stall are not a fresh prefill's (one --seed twice sends the same prompts)"
    )


# ----------------------------------------------------------------------------- summary table


def _fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def format_table(result: BenchResult) -> str:
    m, c = result.metrics, result.config
    title = f" pdserve bench serve: {c.workload.workload} on {result.model} @ {c.client.base_url} "
    scalars = [
        ("Requests completed / failed / not sent", f"{m.completed} / {m.failed} / {m.not_sent}"),
        ("Benchmark duration (s)", _fmt(m.duration_s)),
        ("Input / output tokens", f"{m.total_input_tokens} / {m.total_output_tokens}"),
        ("Workload seed", str(c.workload.seed)),
        ("Request throughput (req/s)", _fmt(m.request_throughput, 3)),
        ("Output token throughput (tok/s)", _fmt(m.output_throughput)),
        ("Total token throughput (tok/s)", _fmt(m.total_token_throughput)),
    ]
    cached = cached_tokens(result.records)
    if cached is not None:
        scalars.append(("Prompt tokens from the server's cache", f"{cached[0]} / {cached[1]}"))
    if m.goodput is not None:
        slo = f"TTFT<={_fmt(m.slo_ttft_ms, 0)}ms TPOT<={_fmt(m.slo_tpot_ms, 0)}ms"
        scalars.append((f"Goodput (req/s) [{slo}]", f"{_fmt(m.goodput, 3)} ({m.slo_met}/{m.completed} met)"))
    dists: list[tuple[str, Dist]] = [
        ("TTFT (ms)", m.ttft_ms),
        ("TPOT (ms)", m.tpot_ms),
        ("ITL (ms)", m.itl_ms),
        ("E2E latency (ms)", m.e2e_ms),
    ]
    if len(m.ttft_ms_by_kind) > 1:
        dists += [(f"TTFT {k} (ms)", d) for k, d in m.ttft_ms_by_kind.items()]
    if m.documents:
        dists += [("Stall per document (ms)", m.stall_ms), ("Tokens lost per document", m.tokens_lost)]
    if m.serving_overhead_ms.count:  # pdserve's timeline: step end at the worker -> chunk here
        dists.append(("Serving overhead (ms)", m.serving_overhead_ms))
    w = max(len(n) for n, _ in scalars + [(n, "") for n, _ in dists]) + 2
    cols = ["count", "mean", "p50", "p90", "p99", "max"]
    width = w + 10 * len(cols)
    lines = [
        title.center(width, "="),
        *(f"{n:<{w}}{v}" for n, v in scalars),
        "-" * width,
        f"{'':<{w}}" + "".join(f"{h:>10}" for h in cols),
    ]
    for name, d in dists:
        vals = [str(d.count), *(_fmt(getattr(d, k)) for k in cols[1:])]
        lines.append(f"{name:<{w}}" + "".join(f"{v:>10}" for v in vals))
    if m.documents:
        lines.append(
            f"(stall: longest inter-token gap of the streams in flight while a document was "
            f"prefilled; {sum(d.stall_s is not None for d in m.documents)}/{len(m.documents)} "
            f"documents had streams in flight)"
        )
    if m.serving_overhead_ms.count:
        lines.append(
            "(serving overhead: per token, its decode step's end at the worker to its chunk at this "
            "client: the event hop, router, SSE and socket; server and client clocks must agree)"
        )
    lines.append("=" * width)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    d_w, d_c = WorkloadConfig(), ClientConfig()
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default=d_c.base_url, help="OpenAI API base URL (/v1 is added if missing)")
    s.add_argument("--model", default=None, help="model name (default: first model listed by /v1/models)")
    s.add_argument("--api-key", default=d_c.api_key)
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=["random", "article", "sharegpt", "multiturn"], default="random")
    g.add_argument("--sharegpt-file", default=None, help="ShareGPT-format JSON (for --workload sharegpt)")
    g.add_argument("--sharegpt-max-output-len", type=int, default=d_w.sharegpt_max_output_len)
    g.add_argument("--num-requests", type=int, default=d_w.num_requests, help="random/sharegpt requests")
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrival rate in req/s (random/sharegpt); inf = all at once",
    )
    g.add_argument("--random-input-len", type=int, default=d_w.random_input_len)
    g.add_argument("--random-output-len", type=int, default=d_w.random_output_len)
    g.add_argument(
        "--random-range-ratio", type=float, default=d_w.random_range_ratio, help="lengths uniform in len*[1-r, 1+r]"
    )
    g.add_argument(
        "--prompt-token-ids",
        action="store_true",
        help="send prompts as lists of token ids (exact lengths on any tokenizer)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seeds the prompts, lengths and arrivals (default: a new seed each run, recorded in the result, so a "
        "rerun's prompts never come from the server's prefix cache; pass it to repeat a run)",
    )
    a = p.add_argument_group("article mix (--workload article)")
    a.add_argument("--chat-streams", type=int, default=d_w.chat_streams)
    a.add_argument("--chat-prompt-len", type=int, default=d_w.chat_prompt_len)
    a.add_argument("--chat-output-len", type=int, default=d_w.chat_output_len)
    a.add_argument("--chat-stagger-s", type=float, default=d_w.chat_stagger_s, help="chat i starts at i*stagger")
    a.add_argument("--doc-prompt-len", type=int, default=d_w.doc_prompt_len)
    a.add_argument("--doc-output-len", type=int, default=d_w.doc_output_len)
    a.add_argument("--doc-count", type=int, default=d_w.doc_count)
    a.add_argument("--doc-rate", type=float, default=None, help="documents/s, Poisson (default: fixed spacing)")
    a.add_argument("--doc-start-s", type=float, default=d_w.doc_start_s)
    a.add_argument("--doc-interval-s", type=float, default=d_w.doc_interval_s)
    d_m = MultiTurnWorkload()
    m = p.add_argument_group("multi-turn chat (--workload multiturn; a pdserve server: it reads the timeline)")
    m.add_argument("--conversations", type=int, default=d_m.conversations, help="chats, run concurrently")
    m.add_argument("--turns", type=int, default=d_m.turns, help="turns per chat, one after another")
    m.add_argument("--system-len", type=int, default=d_m.system_len, help="tokens of the shared system prompt")
    m.add_argument("--user-len", type=int, default=d_m.user_len, help="tokens of each user message")
    m.add_argument("--reply-len", type=int, default=d_m.output_len, help="tokens of each reply")
    c = p.add_argument_group("client")
    c.add_argument("--max-concurrency", type=int, default=None)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask the server to ignore EOS so outputs have exactly max_tokens (vLLM/SGLang/pdserve)",
    )
    c.add_argument("--duration-limit-s", type=float, default=d_c.duration_limit_s)
    c.add_argument("--request-timeout-s", type=float, default=None)
    c.add_argument("--no-progress", action="store_true")
    o = p.add_argument_group("SLO and output")
    o.add_argument("--slo-ttft-ms", type=float, default=None)
    o.add_argument("--slo-tpot-ms", type=float, default=None)
    o.add_argument("--json", action="store_true", help="print the metrics as JSON instead of the table")
    o.add_argument("--out", default=None, help="result name under --out-dir (default: timestamped)")
    o.add_argument("--out-dir", "--results-dir", dest="results_dir", metavar="DIR", default=None, help=OUT_DIR_HELP)


def drawn_seed(args: argparse.Namespace) -> int:
    """--seed, or a fresh one: the same seed twice sends the same prompts, which a server with a
    prefix cache then serves from it (one seeded article run measured a 3,387 ms stall, its repeat 474 ms)."""
    return args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    seed = drawn_seed(args)
    workload = WorkloadConfig(
        workload=args.workload,
        seed=seed,
        prompt_token_ids=args.prompt_token_ids,
        num_requests=args.num_requests,
        request_rate=args.request_rate,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        sharegpt_file=args.sharegpt_file,
        sharegpt_max_output_len=args.sharegpt_max_output_len,
        chat_streams=args.chat_streams,
        chat_prompt_len=args.chat_prompt_len,
        chat_output_len=args.chat_output_len,
        chat_stagger_s=args.chat_stagger_s,
        doc_prompt_len=args.doc_prompt_len,
        doc_output_len=args.doc_output_len,
        doc_count=args.doc_count,
        doc_rate=args.doc_rate,
        doc_start_s=args.doc_start_s,
        doc_interval_s=args.doc_interval_s,
    )
    client = ClientConfig(
        base_url=args.base_url,
        api_key=args.api_key,
        model=args.model,
        temperature=args.temperature,
        seed=seed,
        max_concurrency=args.max_concurrency,
        duration_limit_s=args.duration_limit_s,
        request_timeout_s=args.request_timeout_s,
        ignore_eos=args.ignore_eos,
        show_progress=not args.no_progress,
    )
    return BenchConfig(workload, client, args.slo_ttft_ms, args.slo_tpot_ms)


def multiturn_main(args: argparse.Namespace) -> int:
    """`--workload multiturn`: TTFT by turn, prefix hit rate per side and KV bytes per request of
    the server as it is deployed (bench kvcache compares cache and routing settings)."""
    seed = drawn_seed(args)
    wl = MultiTurnWorkload(args.conversations, args.turns, args.system_len, args.user_len, args.reply_len, seed)
    try:
        wl.validate()
        url = normalize_base_url(args.base_url)
        rows = asyncio.run(run_chats(url, wl, args.model, args.api_key))
    except NoTimeline as e:
        raise CliError(str(e)) from None
    except ValueError as e:
        raise CliError(str(e)) from None
    summary = summarize(rows, wl.turns)
    name = args.out or f"serve_multiturn_{_dt.datetime.now():%Y%m%d_%H%M%S}"
    config = {"workload": asdict(wl), "base_url": url, "model": args.model, "seed_drawn": args.seed is None}
    out_dir = Path(args.results_dir) if args.results_dir else None
    path = write_result(name, {**summary, "records": rows}, config, out_dir)
    if args.json:
        emit_json({"result_file": str(path), **summary})
    else:
        print(
            f"multiturn @ {url}: {wl.conversations} chats x {wl.turns} turns, system prompt {wl.system_len}, "
            f"user {wl.user_len}, reply {wl.output_len} tokens (TTFT: server side, arrival to first token)"
        )
        print("\n".join(table([("this server", summary)], wl.turns)))
        print(f"results: {path}")
    return 0


def main(args: argparse.Namespace) -> int:
    if args.workload == "multiturn":
        return multiturn_main(args)
    config = config_from_args(args)
    try:
        config.workload.validate()
        config.client.validate()
        specs = build_workload(config.workload)
        result = asyncio.run(run_benchmark(config, specs))
    except (ValueError, ClientError) as e:
        raise CliError(str(e)) from None
    name = args.out or f"serve_{config.workload.workload}_{_dt.datetime.now():%Y%m%d_%H%M%S}"
    payload = result.to_dict()
    path = write_result(
        name,
        {k: v for k, v in payload.items() if k != "config"},
        {**payload["config"], "seed_drawn": args.seed is None},  # the seed itself: config.workload.seed
        Path(args.results_dir) if args.results_dir else None,
    )
    for warning in (shape_warning(result.records), cached_documents_warning(result.records)):
        if warning:
            print(f"pdserve bench serve: warning: {warning}", file=sys.stderr)
    if args.json:
        emit_json({"result_file": str(path), "model": result.model, "metrics": payload["metrics"]})
    else:
        print(format_table(result))
        print(f"results: {path}")
    if result.metrics.completed == 0:
        first = next((r.error for r in result.records if r.error), "no request completed")
        print(f"pdserve bench serve: no request completed; first error: {first}", file=sys.stderr)
        return 1
    return 0
