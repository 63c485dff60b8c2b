"""How far one server configuration's decode step moves from one fresh server to the next.

    python -m benchmarks.instance_spread --servers 6 --model smollm2-135m-instruct \\
        --serve-args "--mode colocated --chunk-size 256" --out instance-spread-chunked256

Starts `--servers` fresh `pdserve serve` processes one after another (each on a free port of
127.0.0.1 with a generated API key, stopped by SIGTERM before the next starts) and on each, after
two warm-up requests, times `--runs` rounds of a lone stream then `--batch` streams together
(16-token prompts, 40 tokens, ignore_eos), each stream's pace by the server's own timeline (first
to last token over the tokens between). The 1-thread GEMM pace (benchmarks/pace.py) is read
before each server starts.

Why: a plan is verified on fresh servers, one per candidate, from a calibration measured on
another. Where that server's own steps move from one start to the next by more than a plan's
per-candidate target, the target sits below the floor, and the figure to quote is this one.
Writes one JSON (provenance included) and prints one table; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.engine.cli import table
from benchmarks.pace import machine_pace
from benchmarks.serve_process import ServeProcess, ServeStartError
from costmodel.provenance import RESULTS_DIR, write_result

PROMPT_TOKENS, OUTPUT_TOKENS, WARMUP_REQUESTS = 16, 40, 2


@dataclass(frozen=True)
class Instance:
    index: int
    gemm_gflops: float | None  # the machine's 1-thread GEMM pace just before the server started
    lone_ms: list[float]  # one lone stream's pace per run
    batch_ms: list[float]  # per run: the median pace of the batch's streams

    @property
    def lone_median_ms(self) -> float:
        return statistics.median(self.lone_ms)

    @property
    def batch_median_ms(self) -> float:
        return statistics.median(self.batch_ms)


def stream_pace_ms(client: Any, model: str, token: int) -> float:
    """One stream of OUTPUT_TOKENS after a PROMPT_TOKENS prompt of `token`: its pace by the
    server's timeline (pdserve's `pdserve.timeline` in the response)."""
    r = client.completions.create(
        model=model, prompt=[token] * PROMPT_TOKENS, max_tokens=OUTPUT_TOKENS, extra_body={"ignore_eos": True}
    )
    tl = r.model_extra["pdserve"]["timeline"]
    return (tl["last_token_ms"] - tl["first_token_ms"]) / (tl["output_tokens"] - 1)


def measure(client: Any, model: str, runs: int, batch: int) -> tuple[list[float], list[float]]:
    """`runs` rounds of (a lone stream, `batch` streams at once) on one server, after a warm-up.
    Each stream's prompt is a token of its own, so no stream is served from another's prefix."""
    tokens = iter(range(65, 65 + 10_000))
    for _ in range(WARMUP_REQUESTS):
        stream_pace_ms(client, model, next(tokens))
    lone, together = [], []
    with ThreadPoolExecutor(batch) as pool:
        for _ in range(runs):
            lone.append(stream_pace_ms(client, model, next(tokens)))
            mine = [next(tokens) for _ in range(batch)]
            together.append(statistics.median(pool.map(lambda t: stream_pace_ms(client, model, t), mine)))
    return lone, together


def summary(instances: list[Instance]) -> dict[str, Any]:
    """Per shape: the instances' medians, and the slowest over the fastest."""
    out: dict[str, Any] = {}
    for name, key in (("lone", "lone_median_ms"), ("batch", "batch_median_ms")):
        meds = [getattr(i, key) for i in instances]
        out[name] = {"medians_ms": meds, "max_over_min": max(meds) / min(meds) if meds else None}
    return out


def one_server(index: int, args: argparse.Namespace) -> Instance:
    from openai import OpenAI  # noqa: PLC0415 (the client is only needed once a server is up)

    pace = machine_pace()
    server = ServeProcess(
        ["--model", args.model, *shlex.split(args.serve_args)],
        start_timeout_s=args.startup_timeout_s,
        stop_timeout_s=90,
    )
    try:
        server.start()
    except ServeStartError as e:
        raise SystemExit(f"instance_spread: server {index}: {e}") from None
    with server:
        client = OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)
        lone, together = measure(client, args.model, args.runs, args.batch)
    return Instance(index, pace["gemm_gflops_1thread"] if pace else None, lone, together)


def render(instances: list[Instance], batch: int) -> str:
    headers = ["server", "GEMM GFLOP/s", "lone (ms, per run)", f"batch {batch} (ms, per run)", "lone p50", "batch p50"]
    runs = lambda xs: " ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    rows = [
        [str(i.index), "-" if i.gemm_gflops is None else f"{i.gemm_gflops:.0f}", runs(i.lone_ms), runs(i.batch_ms),
         f"{i.lone_median_ms:.1f}", f"{i.batch_median_ms:.1f}"]
        for i in instances
    ]  # fmt: skip
    s = summary(instances)
    return (
        table(headers, rows) + f"\nslowest server over fastest (medians): lone {s['lone']['max_over_min']:.2f}x, "
        f"batch {batch} {s['batch']['max_over_min']:.2f}x (measured)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.instance_spread", description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, default=6, help="fresh servers, one after another (default 6)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--serve-args", default="--mode colocated --chunk-size 256", help="pdserve serve flags, as typed")
    p.add_argument("--runs", type=int, default=3, help="rounds of (lone, batch) per server (default 3)")
    p.add_argument("--batch", type=int, default=8, help="streams at once in a round's batch (default 8)")
    p.add_argument("--startup-timeout-s", type=float, default=240.0)
    p.add_argument("--out", default="instance-spread")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--json", action="store_true", help="print the result as one JSON document instead of the table")
    args = p.parse_args(argv)
    if min(args.servers, args.runs, args.batch) < 1:
        p.error("--servers, --runs and --batch must be >= 1")
    instances = []
    for k in range(args.servers):
        instances.append(one_server(k, args))
        i = instances[-1]
        print(f"server {k + 1}/{args.servers}: lone {i.lone_median_ms:.1f} ms, batch {i.batch_median_ms:.1f} ms",
              file=sys.stderr, flush=True)  # fmt: skip
    payload = {"instances": [asdict(i) for i in instances], "summary": summary(instances)}
    path = write_result(args.out, payload, config=vars(args), out_dir=args.out_dir)
    if args.json:
        print(json.dumps({**payload, "result": str(path)}))
    else:
        print(render(instances, args.batch))
        print(f"result: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
