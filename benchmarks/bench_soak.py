"""`pdserve bench soak`: N minutes of load against a real `pdserve serve` while a worker is killed
(SIGKILL) every `--fault-interval-s` seconds; what survives.

The server runs as its own process (embedded Ray, token auth, private network namespace where
Linux allows), so its RSS is the router's alone. Clients stream greedy requests drawn from a fixed
set of prompts whose tokens were recorded before the first fault; every request ends as

  ok      all its tokens, equal to the recorded ones
  wrong   it completed but its tokens differ (corrupt KV or state would show here)
  failed  it ended with a clear error (its worker died) -- expected for requests a fault touches
  hung    no end within --hang-s (the bug this benchmark exists to catch)

Each interval one of the server's Ray worker processes (`ray::WorkerHost`, prefill or decode,
drawn at random with --seed) gets SIGKILL; /health tells which pool lost a worker and when it was
full again. Some clients also hang up mid-stream (`--disconnect-every`). At the end the load stops,
and every worker must report zero KV blocks in use (leaked = the sum) with every pool at full size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from cli import CliError
from costmodel.provenance import OUT_DIR_HELP, RESULTS_DIR, write_result

PROMPTS = [f"soak prompt {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 6) for i in range(12)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="how long the load runs (default 10)")
    p.add_argument("--fault-interval-s", type=float, default=30.0, help="one SIGKILL this often (default 30)")
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
class _Server:
    def __init__(self, args: argparse.Namespace, log_path: Path):
        cmd = [sys.executable, "-m", "cli", "serve", "--mode", "disagg", "--model", args.model, "--port", "0",
               "--prefill", str(args.prefill), "--decode", str(args.decode), "--num-blocks", "512",
               "--log-level", "warning"]  # fmt: skip
        self.log_path = log_path
        self._log = open(log_path, "w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline, self.url = time.monotonic() + 300, ""
        while not self.url:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise CliError(f"pdserve serve did not start; its log: {log_path}")
            m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log_path.read_text())
            self.url = m.group(1) if m else ""
            time.sleep(0.3)

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def workers(self) -> list[int]:
        """Pids of the server's live Ray worker actors."""
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if os.getsid(int(d.name)) != self.proc.pid:
                    continue
                if (d / "cmdline").read_bytes().split(b"\0")[0].startswith(b"ray::WorkerHost"):
                    out.append(int(d.name))
            except OSError:
                continue
        return sorted(out)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


# ------------------------------------------------------------------------------ load
async def _one(client: httpx.AsyncClient, prompt: str, max_tokens: int, hang_up: bool) -> tuple[str, list[int]]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
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


async def _load(url: str, args: argparse.Namespace, want: dict[str, list[int]], stop_at: float, log: list) -> None:
    rng = random.Random(args.seed)
    counter = iter(range(1 << 62))
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.hang_s, connect=10)) as client:

        async def worker() -> None:
            while time.monotonic() < stop_at:
                k = next(counter)
                prompt = rng.choice(PROMPTS)
                hang_up = args.disconnect_every > 0 and k % args.disconnect_every == args.disconnect_every - 1
                t0 = time.monotonic()
                try:
                    how, ids = await asyncio.wait_for(_one(client, prompt, args.max_tokens, hang_up), args.hang_s)
                    outcome = how if how != "done" else ("ok" if ids == want[prompt] else "wrong")
                except asyncio.TimeoutError:
                    outcome = "hung"
                except httpx.HTTPError:
                    outcome = "failed"
                log.append((time.monotonic(), outcome, time.monotonic() - t0))

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))


def _health(url: str) -> dict:
    try:
        return httpx.get(url + "/health", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {"status": "unreachable"}


async def _faults(srv: _Server, args: argparse.Namespace, t_start: float, stop_at: float, faults: list) -> None:
    rng = random.Random(args.seed + 1)
    while True:
        await asyncio.sleep(min(args.fault_interval_s, max(0.0, stop_at - time.monotonic())))
        if time.monotonic() >= stop_at - 5:
            return
        pids = srv.workers()
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


async def _rss(srv: _Server, t_start: float, stop_at: float, samples: list) -> None:
    while time.monotonic() < stop_at:
        samples.append((round(time.monotonic() - t_start, 1), round(srv.rss_mb(), 2)))
        await asyncio.sleep(5)


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
    if args.minutes <= 0 or args.fault_interval_s <= 0 or args.concurrency < 1:
        raise CliError("--minutes, --fault-interval-s and --concurrency must be positive")
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    print("starting pdserve serve ...", file=sys.stderr)
    srv = _Server(args, Path(tempfile.mkdtemp(prefix="pdsoak")) / "serve.log")
    try:
        want = {}
        with httpx.Client(base_url=srv.url, timeout=120) as c:  # the reference, before any fault
            for p in PROMPTS:
                body = {"model": "tiny", "prompt": p, "max_tokens": args.max_tokens, "temperature": 0,
                        "ignore_eos": True}  # fmt: skip
                want[p] = c.post("/v1/completions", json=body).json()["pdserve"]["timeline"]["token_ids"]
        log: list = []
        faults: list = []
        rss: list = []
        t_start = time.monotonic()
        stop_at = t_start + args.minutes * 60

        async def run() -> None:
            await asyncio.gather(
                _load(srv.url, args, want, stop_at, log),
                _faults(srv, args, t_start, stop_at, faults),
                _rss(srv, t_start, stop_at, rss),
            )

        print(f"soak: {args.minutes:g} min, a SIGKILL every {args.fault_interval_s:g} s ...", file=sys.stderr)
        asyncio.run(run())
        time.sleep(3)  # leases of requests that died mid-pull run out on the prefill side
        health = _health(srv.url)
        leaked, reporting = _leaked_blocks(srv.url)
    finally:
        exit_code = srv.stop()
    counts = {k: sum(1 for _, o, _ in log if o == k) for k in ("ok", "wrong", "failed", "hung", "disconnected")}
    warm = [m for t, m in rss if t >= 30] or [m for _, m in rss]
    result = {
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
        "outcomes": [(round(t - t_start, 2), o, round(d, 3)) for t, o, d in log],
    }
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    path = write_result(args.name, result, config=config, out_dir=out_dir)
    png = None if args.no_plot else _plot(result, args, out_dir / f"{args.name}.png")
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


def _plot(r: dict, args: argparse.Namespace, path: Path) -> Path:
    import matplotlib  # noqa: PLC0415 - plotting only when asked

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    t, m = zip(*r["rss_mb"]) if r["rss_mb"] else ((), ())
    a1.plot(t, m, color="tab:blue")
    a1.set_ylabel("router RSS (MB)")
    bins: dict[int, dict[str, int]] = {}
    for ts, outcome, _ in r["outcomes"]:
        bins.setdefault(int(ts // 10), {}).setdefault(outcome, 0)
        bins[int(ts // 10)][outcome] += 1
    for outcome, color in (("ok", "tab:green"), ("failed", "tab:orange"), ("hung", "tab:red"), ("wrong", "black")):
        xs = sorted(bins)
        a2.plot([x * 10 + 5 for x in xs], [bins[x].get(outcome, 0) for x in xs], label=outcome, color=color)
    for f in r["faults"]:
        for ax in (a1, a2):
            ax.axvline(f["t_s"], color="grey", lw=0.8, ls="--")
    a2.set_ylabel("requests ended / 10 s")
    a2.set_xlabel("seconds (dashed: a worker SIGKILLed)")
    a2.legend(loc="upper right", fontsize=8)
    fig.suptitle(f"pdserve bench soak: {args.minutes:g} min, {args.concurrency} streams, tiny model, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
