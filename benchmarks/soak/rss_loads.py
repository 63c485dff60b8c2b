"""Worker RSS across repeated loads of varied prompt lengths (issue 40's memory target).

A server of its own (`pdserve serve`, by default tiny 2P2D on 127.0.0.1) gets `--loads` loads of
`--requests` completions each: prompts of random token ids, lengths drawn uniformly in
`--min-len`..`--max-len`, `--concurrency` at once, `--max-tokens` each. After each load every
worker's RSS is read from /metrics. The figure is each worker's growth from the second load to the
last: the first load is warm-up (weights packed, kernels built for new shapes).

`python -m benchmarks.soak.rss_loads [--loads 4] [--requests 180] [--serve-args '...'] [--out NAME]`
writes benchmarks/results/local/<NAME>.json (with provenance) and prints one table.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmarks.engine.cli import table
from benchmarks.serve_process import ServeProcess, ServeStartError
from costmodel.provenance import OUT_DIR_HELP, RESULTS_DIR, write_result

RSS_LINE = re.compile(r"^pdserve_worker_rss_bytes\{(?P<labels>[^}]*)\} (?P<value>\S+)$")


def worker_rss(base: str) -> dict[str, float]:
    """Each worker's RSS in MB, from the server's /metrics."""
    out = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if m := RSS_LINE.match(line):
            name = re.search(r'worker="([^"]+)"', m["labels"])
            if name:
                out[name[1]] = float(m["value"]) / 2**20
    return out


def one_load(base: str, rng: random.Random, args: argparse.Namespace) -> dict[str, Any]:
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.requests)]
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]

    def send(prompt: list[int]) -> bool:
        body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
        r = httpx.post(base + "/v1/completions", json=body, timeout=300)
        return r.status_code == 200

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        ok = sum(pool.map(send, prompts))
    return {"requests": len(prompts), "ok": ok, "seconds": time.perf_counter() - t0, "rss_mb": worker_rss(base)}


def run_loads(base: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """`--loads` loads one after another, each reported on stderr as it ends."""
    rng = random.Random(args.seed)
    loads: list[dict[str, Any]] = []
    for i in range(args.loads):
        loads.append(one_load(base, rng, args))
        print(f"rss_loads: load {i + 1}: {loads[-1]['ok']}/{args.requests} ok in {loads[-1]['seconds']:.0f} s, "
              f"RSS {', '.join(f'{k} {v:.0f}' for k, v in sorted(loads[-1]['rss_mb'].items()))} MB",
              file=sys.stderr)  # fmt: skip
    return loads


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--serve-args", default="--mode disagg --prefill 2 --decode 2", help="more `pdserve serve` flags")
    p.add_argument("--loads", type=int, default=4)
    p.add_argument("--requests", type=int, default=180, help="requests per load")
    p.add_argument("--min-len", type=int, default=15)
    p.add_argument("--max-len", type=int, default=1485)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--port", type=int, default=8131)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="rss-loads")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    args = p.parse_args(argv)
    if args.loads < 2:
        print("rss_loads: --loads must be >= 2 (growth is from the second load)", file=sys.stderr)
        return 2
    # no API key: the loads' requests carry none
    server = ServeProcess(
        ["--model", args.model, *shlex.split(args.serve_args)],
        port=args.port,
        with_api_key=False,
        start_timeout_s=300,
        stop_timeout_s=60,
    )
    try:
        server.start()
    except ServeStartError as e:
        print(f"rss_loads: the server did not start: {e}", file=sys.stderr)
        return 1
    with server:
        load_avg = os.getloadavg()[0]
        loads = run_loads(server.url, args)
    workers = sorted(loads[-1]["rss_mb"])
    growth = {w: 100 * (loads[-1]["rss_mb"][w] / loads[1]["rss_mb"][w] - 1) for w in workers if w in loads[1]["rss_mb"]}
    result = {"bench": "rss-loads", "load_average_at_start": load_avg, "loads": loads, "growth_pct_2nd_to_last": growth}
    path = write_result(
        args.out, result, config=vars(args), out_dir=Path(args.out_dir) if args.out_dir else RESULTS_DIR
    )
    rows = [
        [w, *(f"{ld['rss_mb'].get(w, float('nan')):.0f}" for ld in loads), f"{growth.get(w, float('nan')):+.2f}%"]
        for w in workers
    ]
    headers = ["worker", *(f"load {i + 1} MB" for i in range(len(loads))), "2nd -> last"]
    print(table(headers, rows))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
