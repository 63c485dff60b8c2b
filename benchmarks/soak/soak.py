"""`pdserve bench soak`: N minutes of load against a real `pdserve serve` while a worker is killed
(SIGKILL) every `--fault-interval-s` seconds (0: never); what survives, and whether memory stays flat.

The server runs as its own process (embedded Ray, token auth, private network namespace where
Linux allows). Clients stream greedy requests from a workload (benchmarks/soak/workload.py):
`real` (default) draws prompt lengths over the model's range, chat and documents mixed, prefix
sharing on, and checks repeated prompts against their first answer; `fixed` is a dozen
prompts, recorded before the first fault. Every request ends as

  ok      all its tokens, equal to the reference ones (or the first answer to a new prompt)
  wrong   it completed but its tokens differ (corrupt KV or state would show here)
  failed  it ended with a clear error (its worker died) -- expected for requests a fault touches
  hung    no end within --hang-s (the bug this benchmark exists to catch)

Each interval one of the server's Ray worker processes (`ray::WorkerHost`, prefill or decode,
drawn at random with --seed) gets SIGKILL; /health tells which pool lost a worker and when it was
full again. Some clients also hang up mid-stream (`--disconnect-every`). At the end the load stops,
and every worker must report zero KV blocks in use (leaked = the sum) with every pool at full size.

Memory: every `--rss-interval-s` the RSS of the router process (/proc) and of each worker (its
`pdserve_worker_rss_bytes` gauge on /metrics, with its C heap in use and kept free beside it) is
sampled; the result gives each worker's growth after the warm-up (first to last sample, and by
the medians of the window's first and last two minutes, which a long prompt's live activations in
one sample do not move) (`--warmup-min`, default the first third) and plots RSS per worker over time.
Workers that a fault replaced start a new series (their own warm-up is in the window: they are
reported, but only workers that lived through the whole window count for the flatness figure).
The server's own RSS warnings (`--rss-growth-warn-mb`) are counted from its log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.serve_process import ServeProcess, ServeStartError
from benchmarks.soak.memory import MEDIAN_S, rss_growth, worker_memory
from benchmarks.soak.plot import plot_soak
from benchmarks.soak.workload import FIXED_PROMPTS, WORKLOADS, FixedWorkload, RealShapedWorkload, Workload
from cli import CliError
from costmodel.provenance import OUT_DIR_HELP, RESULTS_DIR, write_result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="how long the load runs (default 10)")
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="real",
        help="real: prompt lengths over the model's range, chat + documents, prefix sharing, repeats checked "
        "(default); fixed: a dozen prompts",
    )
    p.add_argument("--fault-interval-s", type=float, default=30.0, help="one SIGKILL this often; 0: none (default 30)")
    p.add_argument("--rss-interval-s", type=float, default=5.0, help="RSS sampled this often (default 5)")
    p.add_argument(
        "--warmup-min", type=float, default=None, help="minutes before RSS growth counts (default: a third of the run)"
    )
    p.add_argument(
        "--rss-growth-warn-mb", type=float, default=None, help="passed to pdserve serve (default: its default)"
    )
    p.add_argument(
        "--serve-args",
        default="",
        help="more `pdserve serve` flags, one string (e.g. '--gemm-row-buckets 0' to see issue 22's growth)",
    )
    p.add_argument("--concurrency", type=int, default=6, help="client streams at once (default 6)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request (default 48)")
    p.add_argument("--hang-s", type=float, default=60.0, help="a request not ended after this is hung (default 60)")
    p.add_argument("--disconnect-every", type=int, default=10, help="every Nth request hangs up mid-stream (0: never)")
    p.add_argument("--prefill", type=int, default=2, help="prefill workers (default 2)")
    p.add_argument("--decode", type=int, default=2, help="decode workers (default 2)")
    p.add_argument("--model", default="tiny", help="model (default tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result object as JSON instead of the table")
    p.add_argument("--name", default="soak", help="result file name")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--no-plot", action="store_true")


# ------------------------------------------------------------------------------ the server process
def _start_server(args: argparse.Namespace, log_path: Path) -> ServeProcess:
    """A disaggregated server with no API key, leading a session of its own: its Ray workers are
    the processes of that session (`_ray_workers`), and a SIGKILL after a stuck shutdown takes them too."""
    flags = ["--mode", "disagg", "--model", args.model, "--prefill", str(args.prefill), "--decode", str(args.decode),
             "--num-blocks", "512", "--log-level", "warning"]  # fmt: skip
    if args.rss_growth_warn_mb is not None:
        flags += ["--rss-growth-warn-mb", str(args.rss_growth_warn_mb)]
    flags += shlex.split(args.serve_args)
    srv = ServeProcess(
        flags, with_api_key=False, log_path=log_path, new_session=True, start_timeout_s=300, stop_timeout_s=120
    )
    try:
        return srv.start()
    except ServeStartError as e:
        raise CliError(str(e)) from None


def _rss_mb(pid: int) -> float:
    """A process's resident set in MB (here the router: the server's main process)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _ray_workers(session: int) -> list[int]:
    """Pids of the live Ray worker actors in the server's session."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getsid(int(d.name)) != session:
                continue
            if (d / "cmdline").read_bytes().split(b"\0")[0].startswith(b"ray::WorkerHost"):
                out.append(int(d.name))
        except OSError:
            continue
    return sorted(out)


# ------------------------------------------------------------------------------ load
async def _one(
    client: httpx.AsyncClient, model: str, prompt: list[int] | str, max_tokens: int, hang_up: bool
) -> tuple[str, list[int]]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    ids: list[int] = []
    n = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return "failed", []
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                return "failed", []
            n += 1
            if hang_up and n == 3:
                return "disconnected", []
            tl = data.get("pdserve", {}).get("timeline")
            if tl:
                ids = tl["token_ids"]
    return "done", ids


async def _load(
    url: str, args: argparse.Namespace, workload: Workload, want: dict[str, list[int]], stop_at: float, log: list
) -> None:
    """Streams until `stop_at`; a prompt's first complete answer is its reference if `want` has none."""
    counter = iter(range(1 << 62))
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.hang_s, connect=10)) as client:

        async def worker() -> None:
            while time.monotonic() < stop_at:
                k = next(counter)
                req = workload.next()
                hang_up = args.disconnect_every > 0 and k % args.disconnect_every == args.disconnect_every - 1
                t0 = time.monotonic()
                try:
                    how, ids = await asyncio.wait_for(
                        _one(client, args.model, req.prompt, args.max_tokens, hang_up), args.hang_s
                    )
                    outcome = how if how != "done" else ("ok" if want.setdefault(req.key, ids) == ids else "wrong")
                except asyncio.TimeoutError:
                    outcome = "hung"
                except httpx.HTTPError:
                    outcome = "failed"
                log.append((time.monotonic(), outcome, time.monotonic() - t0, req.kind, req.prompt_len))

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))


def _health(url: str) -> dict:
    try:
        return httpx.get(url + "/health", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {"status": "unreachable"}


async def _faults(srv: ServeProcess, args: argparse.Namespace, t_start: float, stop_at: float, faults: list) -> None:
    rng = random.Random(args.seed + 1)
    while True:
        await asyncio.sleep(min(args.fault_interval_s, max(0.0, stop_at - time.monotonic())))
        if time.monotonic() >= stop_at - 5:
            return
        pids = _ray_workers(srv.pid)
        if not pids:
            continue
        victim = rng.choice(pids)
        t_kill = time.monotonic()
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            continue
        pool, full_after = None, None
        while time.monotonic() - t_kill < 60:
            h = await asyncio.to_thread(_health, srv.url)
            pools = h.get("pools", {})
            short = [p for p, s in pools.items() if s["live"] < s["configured"]]
            if short and pool is None:
                pool = short[0]
            if pool is not None and h.get("status") == "ok":
                full_after = time.monotonic() - t_kill
                break
            await asyncio.sleep(0.1)
        faults.append({"t_s": round(t_kill - t_start, 1), "pid": victim, "pool": pool,
                       "replaced_after_s": None if full_after is None else round(full_after, 2)})  # fmt: skip


async def _rss(
    srv: ServeProcess, interval_s: float, t_start: float, stop_at: float, router: list, workers: dict
) -> None:
    while time.monotonic() < stop_at:
        t = round(time.monotonic() - t_start, 1)
        router.append((t, round(_rss_mb(srv.pid), 2)))
        for name, (role, mb) in (await asyncio.to_thread(worker_memory, srv.url)).items():
            series = workers.setdefault(name, {"role": role, "samples": [], "heap_samples": []})
            if "rss" in mb:
                series["samples"].append((t, round(mb["rss"], 2)))
            if "heap_in_use" in mb:
                series["heap_samples"].append((t, round(mb["heap_in_use"], 2), round(mb.get("heap_free", 0.0), 2)))
        await asyncio.sleep(interval_s)


def _leaked_blocks(url: str) -> tuple[int, int]:
    """(blocks in use summed over workers, workers reporting), once the load has stopped."""
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        used = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("pdserve_kv_blocks_used{")]
        if sum(used) == 0 or time.monotonic() > deadline:
            return int(sum(used)), len(used)
        time.sleep(0.5)


# ------------------------------------------------------------------------------ main
def main(args: argparse.Namespace) -> int:
    if args.minutes <= 0 or args.fault_interval_s < 0 or args.concurrency < 1 or args.rss_interval_s <= 0:
        raise CliError("--minutes, --concurrency and --rss-interval-s must be positive, --fault-interval-s >= 0")
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    print("starting pdserve serve ...", file=sys.stderr)
    log_path = Path(tempfile.mkdtemp(prefix="pdsoak")) / "serve.log"  # kept: the result counts its RSS warnings
    with _start_server(args, log_path) as srv:  # up already: the with stops it
        want: dict[str, list[int]] = {}
        workload: Workload
        if args.workload == "fixed":
            workload = FixedWorkload(args.seed)
            with httpx.Client(base_url=srv.url, timeout=120) as c:  # the reference, before any fault
                for p in FIXED_PROMPTS:
                    body = {"model": args.model, "prompt": p, "max_tokens": args.max_tokens, "temperature": 0,
                            "ignore_eos": True}  # fmt: skip
                    want[p] = c.post("/v1/completions", json=body).json()["pdserve"]["timeline"]["token_ids"]
        else:
            ctx = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
            workload = RealShapedWorkload(ctx - args.max_tokens, seed=args.seed)
        log: list = []
        faults: list = []
        rss: list = []
        workers_rss: dict[str, dict] = {}
        t_start = time.monotonic()
        stop_at = t_start + args.minutes * 60

        async def run() -> None:
            tasks = [
                _load(srv.url, args, workload, want, stop_at, log),
                _rss(srv, args.rss_interval_s, t_start, stop_at, rss, workers_rss),
            ]
            if args.fault_interval_s > 0:
                tasks.append(_faults(srv, args, t_start, stop_at, faults))
            await asyncio.gather(*tasks)

        every = f"a SIGKILL every {args.fault_interval_s:g} s" if args.fault_interval_s > 0 else "no faults"
        print(f"soak: {args.minutes:g} min, {args.workload} workload, {every} ...", file=sys.stderr)
        asyncio.run(run())
        time.sleep(3)  # leases of requests that died mid-pull run out on the prefill side
        health = _health(srv.url)
        leaked, reporting = _leaked_blocks(srv.url)
    exit_code = srv.returncode
    counts = {k: sum(1 for _, o, *_ in log if o == k) for k in ("ok", "wrong", "failed", "hung", "disconnected")}
    warm = [m for t, m in rss if t >= 30] or [m for _, m in rss]
    warm_s = (args.warmup_min if args.warmup_min is not None else args.minutes / 3) * 60
    slack_s = 3 * args.rss_interval_s
    end_s = rss[-1][0] if rss else 0.0
    for series in workers_rss.values():
        series["growth_after_warmup"] = rss_growth(series["samples"], warm_s, end_s, slack_s)
        in_use = [(t, used) for t, used, _ in series.get("heap_samples", [])]
        series["heap_in_use_growth_after_warmup"] = rss_growth(in_use, warm_s, end_s, slack_s) if in_use else None
    spanning = [s["growth_after_warmup"] for s in workers_rss.values() if s["growth_after_warmup"]]
    lens = [n for *_, n in log if n is not None]
    result = {
        "workload": args.workload,
        "prompt_len": {"min": min(lens), "max": max(lens), "distinct": len(set(lens))} if lens else None,
        "requests_by_kind": {k: sum(1 for *_, kind, _ in log if kind == k) for k in ("chat", "doc", "fixed")},
        "distinct_prompts": len(want),
        "warmup_s": warm_s,
        "workers_rss_mb": workers_rss,
        "worker_rss_max_growth_pct_after_warmup": max((g["max_growth_pct"] for g in spanning), default=None),
        "worker_rss_growth_pct_after_warmup": max((g["growth_pct"] for g in spanning), default=None),
        "worker_rss_median_growth_pct_after_warmup": max((g["median_growth_pct"] for g in spanning), default=None),
        "rss_warnings_in_server_log": log_path.read_text().count("since warm-up"),
        "counts": counts,
        "requests": len(log),
        "faults": faults,
        "leaked_blocks": leaked,
        "workers_reporting": reporting,
        "pools_at_end": health.get("pools"),
        "health_at_end": health.get("status"),
        "server_exit_code_after_sigterm": exit_code,
        "rss_mb": rss,
        "rss_growth_pct_after_warmup": round((warm[-1] / warm[0] - 1) * 100, 2) if len(warm) > 1 else None,
        "max_replaced_after_s": max((f["replaced_after_s"] or float("inf") for f in faults), default=None),
        "outcomes": [(round(t - t_start, 2), o, round(d, 3), kind, n) for t, o, d, kind, n in log],
    }
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    path = write_result(args.name, result, config=config, out_dir=out_dir)
    png = None if args.no_plot else plot_soak(result, args, out_dir / f"{args.name}.png")
    if args.json:
        from cli.output import emit_json  # noqa: PLC0415 - only for --json

        emit_json(result)
    else:
        _print_table(result, args)
        print(f"\nwrote {path}" + (f" and {png}" if png else ""))
    ok = counts["hung"] == 0 and counts["wrong"] == 0 and leaked == 0 and health.get("status") == "ok"
    return 0 if ok else 1


def _print_table(r: dict, args: argparse.Namespace) -> None:
    c = r["counts"]
    print(f"soak: {args.minutes:g} min, {args.concurrency} streams, a SIGKILL every {args.fault_interval_s:g} s")
    print(f"{'requests':>9} {'ok':>6} {'wrong':>6} {'failed':>7} {'hung':>5} {'hung up':>8} {'faults':>7} "
          f"{'max replace s':>13} {'leaked blocks':>13} {'RSS growth %':>12}")  # fmt: skip
    replace = r["max_replaced_after_s"]
    growth = r["rss_growth_pct_after_warmup"]
    print(f"{r['requests']:>9} {c['ok']:>6} {c['wrong']:>6} {c['failed']:>7} {c['hung']:>5} {c['disconnected']:>8} "
          f"{len(r['faults']):>7} {replace if replace is not None else '-':>13} {r['leaked_blocks']:>13} "
          f"{growth if growth is not None else '-':>12}")  # fmt: skip
    print(f"pools at the end: {r['pools_at_end']} ({r['health_at_end']}); server exit after SIGTERM: "
          f"{r['server_exit_code_after_sigterm']}")  # fmt: skip
    if r["prompt_len"]:
        pl = r["prompt_len"]
        kinds = r["requests_by_kind"]
        print(f"prompts: {pl['distinct']} distinct lengths in {pl['min']}..{pl['max']}; by kind {kinds}")
    print(f"\nworker RSS after the warm-up ({r['warmup_s'] / 60:g} min; MB):")
    print(f"{'worker':<14} {'role':<9} {'start':>8} {'from':>8} {'to':>8} {'max':>8} {'growth %':>9} {'max %':>7} "
          f"{'median %':>9} {'heap in use %':>13}")  # fmt: skip
    for name, s in r["workers_rss_mb"].items():
        g, start = s["growth_after_warmup"], s["samples"][0][1] if s["samples"] else float("nan")
        if g is None:
            print(f"{name:<14} {s['role']:<9} {start:>8.0f}  (not alive through the window: killed or a replacement)")
            continue
        h = s.get("heap_in_use_growth_after_warmup")
        heap = f"{h['median_growth_pct']:>13.2f}" if h else f"{'-':>13}"
        print(f"{name:<14} {s['role']:<9} {start:>8.0f} {g['from_mb']:>8.0f} {g['to_mb']:>8.0f} {g['max_mb']:>8.0f} "
              f"{g['growth_pct']:>9.2f} {g['max_growth_pct']:>7.2f} {g['median_growth_pct']:>9.2f} {heap}")  # fmt: skip
    print(f"(median %: the medians of the window's first and last {MEDIAN_S / 60:g} minutes; heap in use: glibc's "
          "malloc'd-and-not-freed bytes, read the same way)")  # fmt: skip
    print(f"RSS warnings in the server log: {r['rss_warnings_in_server_log']}")
