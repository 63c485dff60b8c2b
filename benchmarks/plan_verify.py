"""`pdserve plan`, and `--verify K`: the plan's top K candidates (and the best fixed baseline)
deployed on this machine, the workload run on each, predicted beside measured.

The plan itself is costmodel/plan_cli.py (nothing there is measured); this module is the
command's entry point because verifying needs servers and a client, which live in this layer.

For each candidate, one at a time: a fresh pdserve server (Ray actors + uvicorn on a free
loopback port, as `bench compare` starts them), warmed as `bench compare` warms its servers (the
workload's schedule and lengths twice with other token ids, so the timed prompts are not in the
prefix cache and no shape is met cold, and a few lone requests), then the timed pass. Measured
figures are judged exactly as the plan judges its simulated ones (`costmodel.plan.score.judge`):
p90 of TTFT and TPOT over the requests and of the stall over the documents, each SLO's
attainment (the share within it), goodput per worker. The regret is how much measured goodput
per worker the plan's winner gives up against the best candidate measured: (best - winner) / best.
Each candidate is also predicted again at its server's own pace against the calibration's, read after
its warm-up (benchmarks/plan_calibration.py `serving_pace`): on a shared VM a deployment's steps ran
0.84-1.18x their price from one hour to the next, which no plan made beforehand can know.

The fixed baselines are the deployments a user would run without a plan: the whole budget
colocated, and disaggregated with the budget split evenly (KV pulled whole); the better of the
two by the plan's own ranking is verified beside the top K when it is not among them.

`--repeats R` measures every candidate R times, in rounds whose order alternates (A B C, then
C B A: a machine that drifts steadily weighs on each candidate alike), on a fresh server each
time; each row is the mean of its rounds, and the spread between rounds is reported beside the
prediction's error (benchmarks/verify_rows.py `combine`): on a shared VM whose pace moves within
the hour, a prediction cannot be held closer than the measurement repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from benchmarks import plan_reprice, plan_reprice_all
from benchmarks.client.bench_serve import BenchConfig, run_benchmark
from benchmarks.client.gc_pauses import QuietGC
from benchmarks.client.serve_client import ClientConfig
from benchmarks.client.step_log import StepLogRecorder
from benchmarks.compare.calibrate.side_requests import hop_specs
from benchmarks.compare.modes import ensure_ray, load_average
from benchmarks.pace import describe as describe_pace
from benchmarks.pace import machine_pace
from benchmarks.plan_calibration import calibrated_elsewhere, compare_fits, pace_burst, serving_pace
from benchmarks.prompt_threads import host_threads
from benchmarks.verify_rows import VerifyRow, combine, format_verification, per_request, summarize
from benchmarks.verify_steps import step_pace, step_prices
from cli import CliError
from cli.output import emit_json
from costmodel import plan_cli
from costmodel.plan.candidates import Candidate
from costmodel.plan.score import Judged, Scored, Slos, goodput_interval, judge, priced_at, score
from costmodel.provenance import OUT_DIR_HELP, write_result
from costmodel.sim.compare_predict import PredictionSetup
from costmodel.workloads import RequestSpec

TOKEN_LOW, TOKEN_HIGH = 32, 127  # prompt token ids, as the workloads draw them (printable bytes)
MAX_VERIFY = 8
MAX_REPEATS = 4
QUIET_LOAD = 0.5  # one-minute load average a candidate's server may start at (`--settle-s`)


def add_arguments(p: argparse.ArgumentParser) -> None:
    plan_cli.add_arguments(p)
    v = p.add_argument_group("verification (deploys and measures on this machine)")
    v.add_argument(
        "--verify",
        type=int,
        default=0,
        metavar="K",
        help="deploy the top K candidates and the best fixed baseline (whole budget colocated, or split "
        "evenly disaggregated) one after another, run the workload on each, and print predicted against "
        "measured attainment and goodput, with the regret; 0 (default) = plan only",
    )
    v.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="R",
        help=f"measure each candidate R times (1-{MAX_REPEATS}), in rounds of alternating order on fresh servers; "
        "each row is the mean of its rounds and the spread between them is printed (default 1)",
    )
    v.add_argument("--device", default="cpu", help="where verified servers run (default cpu)")
    v.add_argument("--startup-timeout-s", type=float, default=300.0, help="per server (default 300)")
    v.add_argument(
        "--settle-s",
        type=float,
        default=120.0,
        help="before each server, wait up to this long for the one-minute load average to fall under 0.5 "
        "(the last candidate's run lingers in it), and record it (default 120; 0 = do not wait)",
    )
    v.add_argument(
        "--base-url",
        default=None,
        help="verify on a server you run (any OpenAI-compatible one) instead of servers started here: before "
        "each candidate the plan prints its `pdserve serve` command and waits for Enter once you have restarted "
        "the server at this URL so (interactive)",
    )
    v.add_argument("--api-key", default="EMPTY", help="with --base-url: the server's API key")
    plan_reprice.add_argument(v)
    v.add_argument("--out", default=None, help="verification result name (default plan-verify-<workload>)")
    v.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)


def main(args: argparse.Namespace) -> int:
    if args.reprice:
        if args.verify:
            raise CliError("--reprice re-reads a verification already run: give it without --verify")
        bare = argparse.ArgumentParser()
        add_arguments(bare)
        if Path(args.reprice).is_dir():  # every result in the folder: the accuracy ledger
            return plan_reprice_all.main(args, bare.parse_args([]))
        return plan_reprice.main(args, bare.parse_args([]))
    if not args.model:
        raise CliError("--model is required (the served model: its shapes price the steps)")
    if args.verify < 0 or args.verify > MAX_VERIFY:
        raise CliError(f"--verify must be 0-{MAX_VERIFY} (each candidate is a server started and loaded)")
    if not 1 <= args.repeats <= MAX_REPEATS:
        raise CliError(f"--repeats must be 1-{MAX_REPEATS}")
    if args.repeats > 1 and not args.verify:
        raise CliError("--repeats is how often --verify K measures each candidate: give --verify too")
    if args.base_url and not args.verify:
        raise CliError("--base-url is where --verify K measures: give --verify too")
    if args.base_url and not sys.stdin.isatty():
        raise CliError(
            "--verify --base-url waits for you to restart the server between candidates: run it in a terminal"
        )
    by_kind = compare_fits(args)
    elsewhere = calibrated_elsewhere(args) if by_kind else None
    threads = None if by_kind else host_threads(args.workers)
    if not args.verify:
        return plan_cli.main(args, by_kind, [elsewhere] if elsewhere else [], threads)
    plan = plan_cli.make_plan(args, by_kind, [elsewhere] if elsewhere else [], threads)
    if elsewhere:
        log(f"note: {elsewhere}")
    if not args.json:
        plan_cli.print_plan(plan)
    chosen = to_verify(plan.ranked, args.verify, args.workers)
    log(f"\nverifying {len(chosen)} candidates on this machine: {', '.join(s.candidate.label for s in chosen)}")
    if not args.base_url:
        ensure_ray()
    measured: dict[int, list[VerifyRow]] = {i: [] for i in range(len(chosen))}
    total, done = len(chosen) * args.repeats, 0
    for rnd in range(args.repeats):
        order = list(range(len(chosen)))
        for i in order if rnd % 2 == 0 else order[::-1]:
            s, done = chosen[i], done + 1
            settle(args.settle_s)
            round_note = f" (round {rnd + 1} of {args.repeats})" if args.repeats > 1 else ""
            log(f"[{done}/{total}] {s.candidate.label}{round_note}: {' '.join(s.candidate.serve_args())}")
            setup = plan.setup_of(s.candidate)
            # one CPU's pace does not scale another CPU's steps: no pace-adjusted figure then
            at_pace = setup if not elsewhere else None
            rank = plan.ranked.index(s) + 1
            measured[i].append(verify_one(s, rank, plan.specs, plan.slos, args, setup, at_pace))
    rows = [combine(measured[i]) for i in range(len(chosen))]
    summary = summarize(rows, plan.ranked[0].candidate.label, plan.slos.stall_ms)
    verification = {"rows": [r.to_dict() for r in rows], **summary, "calibrated_elsewhere": elsewhere}
    doc = {**plan.doc, "verification": verification}
    name = args.out or f"plan-verify-{args.workload if not args.trace else 'trace'}"
    config = {k: v for k, v in vars(args).items() if k not in ("json", "func", "handler")}
    path = write_result(name, doc, config=config, out_dir=args.out_dir)
    if args.json:
        emit_json(doc)
        return 0
    print(format_verification(rows, summary))
    print(f"\nresult: {path}")
    return 0


def to_verify(ranked: list[Scored], k: int, budget: int) -> list[Scored]:
    """The top `k`; then the candidate with the most goodput at the fit's own prices among those
    meeting every SLO there, if the risk ranking put it lower (a rule too cautious would otherwise
    hide its cost: the best falls out of the verified set and the regret reads low); then the
    better-ranked fixed baseline if it is not among them."""
    top = ranked[:k]
    at_fit = max((s for s in ranked if s.meets), key=lambda s: s.goodput_per_worker, default=None)
    if at_fit is not None and at_fit not in top:
        top.append(at_fit)
    fixed = {Candidate("colocated", budget)}
    if budget >= 2:
        fixed.add(Candidate("disagg", budget - budget // 2, budget // 2))
    baseline = next((s for s in ranked if replace(s.candidate, prefix_policy=False) in fixed), None)
    if baseline is not None and baseline not in top:
        top.append(baseline)
    return top


def verify_one(
    s: Scored,
    rank: int,
    specs: list[RequestSpec],
    slos: Slos,
    args: argparse.Namespace,
    setup: PredictionSetup | None = None,
    at_pace: PredictionSetup | None = None,
    serve_flags: dict[str, Any] | None = None,
) -> VerifyRow:
    """Deploy `s`'s candidate (plus `serve_flags`, unpriced: benchmarks/serve_flags_ab.py) fresh, warm it,
    time the workload, judge it; with the `setup` that priced it, say what its steps cost against those
    prices, and with `at_pace` (that setup, calibrated on this CPU) predict it again at today's pace: the
    server's own, its steps for requests of the workload's shapes against those prices before the timed
    pass (`serving_pace`), or where it logs no steps the GEMM probe's before it started."""
    from router.config import ConfigError, ServeConfig  # noqa: PLC0415 (starts nothing until used)
    from router.serve_cli import ServerThread  # noqa: PLC0415

    c = s.candidate
    predicted = Judged(s.attainment, s.meets, s.goodput_per_worker)
    row = VerifyRow(c, rank, predicted, None, {}, load_average=load_average(), pace=machine_pace(),
                    miss_risk=s.risk.miss_chance if s.risk else None, goodput_interval=goodput_interval(s))  # fmt: skip
    log(f"  load {row.load_average[0] if row.load_average else '?'}, {describe_pace(row.pace)}")
    if at_pace is not None and at_pace.pace_gflops and row.pace:  # a server's own steps replace it
        row.pace_basis = "gemm"
        row.pace_ratio = at_pace.pace_gflops / row.pace["gemm_gflops_1thread"]
        again = score(s.candidate, priced_at(at_pace, row.pace_ratio), specs, slos, args.max_num_seqs)
        row.pace_adjusted = Judged(again.attainment, again.meets, again.goodput_per_worker)
        log(
            f"  at this pace (steps {row.pace_ratio:.2f}x the calibration's): predicted goodput/worker "
            f"{again.goodput_per_worker:.3f}/s"
        )
    if args.base_url:
        return _measure(row, s, specs, slos, args, setup, lambda: _restarted(s.candidate, args), at_pace)
    try:
        pools = c.mode in ("disagg", "auto")
        cfg = ServeConfig(
            model=args.model,
            device=args.device,
            mode=c.mode if pools else "colocated",
            chunk_size=c.chunk,
            prefill=max(1, c.prefill),
            decode=c.decode,
            kv_transfer=c.kv_transfer if pools else "bulk",
            max_num_seqs=args.max_num_seqs,
            policy=c.policy or ServeConfig.policy,
        )
        if c.mode == "auto":  # the SLOs its router decides under, from the step fit it starts with
            cfg = replace(cfg, slo_ttft_ms=c.slo_ttft_ms, slo_itl_ms=c.slo_itl_ms, calibration=c.calibration)
        cfg = ServeConfig.build({**{f.name: getattr(cfg, f.name) for f in fields(cfg)}, **(serve_flags or {})})
    except ConfigError as e:
        row.error = f"not deployable here: {e}"
        return row
    started = lambda: _started(ServerThread(cfg, startup_timeout_s=args.startup_timeout_s), cfg)  # noqa: E731
    return _measure(row, s, specs, slos, args, setup, started, at_pace)


@dataclass(frozen=True)
class _Target:
    """The server a candidate is measured on: its root URL, the model to ask for (None: the first
    it lists), its API key."""

    url: str
    model: str | None
    api_key: str | None


@contextmanager
def _started(server: Any, cfg: Any) -> Iterator[_Target]:
    with server as srv:
        yield _Target(srv.url, cfg.model_name, cfg.api_key)


@contextmanager
def _restarted(c: Candidate, args: argparse.Namespace) -> Iterator[_Target]:
    """--base-url: the user restarts their server as the candidate, and says so."""
    command = f"pdserve serve --model {args.model} {' '.join(c.serve_args())}"
    log(f"  restart the server at {args.base_url} as:\n    {command}")
    input("  then press Enter ")
    yield _Target(args.base_url.rstrip("/").removesuffix("/v1"), None, args.api_key)


def _measure(
    row: VerifyRow,
    s: Scored,
    specs: list[RequestSpec],
    slos: Slos,
    args: argparse.Namespace,
    setup: PredictionSetup | None,
    server: Callable[[], AbstractContextManager[_Target]],
    at_pace: PredictionSetup | None = None,
) -> VerifyRow:
    """Warm the candidate's server, time the workload on it, judge it."""
    c = s.candidate
    t0 = time.perf_counter()
    try:
        with server() as srv:
            row.startup_s = time.perf_counter() - t0
            client = ClientConfig(
                base_url=srv.url + "/v1", model=srv.model, api_key=srv.api_key or "EMPTY", show_progress=False,
                seed=args.seed,
            )  # fmt: skip
            bench = BenchConfig(client=client, slo_ttft_ms=slos.ttft_ms, slo_tpot_ms=slos.tpot_ms)
            # warmed as `bench compare` warms the servers its calibrations come from (benchmarks/
            # compare/modes.py): a fresh server's first step of a shape runs cold, and a pass's
            # Poisson gaps leave some shapes to the next; then the timed pass without a full GC of
            # this process (the router and the client) in the middle of it
            log(f"  up in {row.startup_s:.1f} s; warm-up: the workload twice (other token ids), lone requests")
            first = fresh_prompts(specs, args.seed + 1)
            asyncio.run(run_benchmark(bench, first))
            asyncio.run(run_benchmark(bench, hop_specs(first)))
            asyncio.run(run_benchmark(bench, fresh_prompts(specs, args.seed + 3)))
            if at_pace:
                row.pace_steps = serving_pace(
                    bench, srv.url, srv.api_key, specs, pace_burst(s), args.seed + 4, log, c.chunk
                )
            paced = step_pace(row.pace_steps, at_pace) if at_pace else None
            if paced:
                log(f"  steps at {paced.describe()} the plan's prices")
            log("  timed pass")
            with StepLogRecorder(srv.url, srv.api_key) as recorder, QuietGC():  # not pdserve's: no steps
                result = asyncio.run(run_benchmark(bench, fresh_prompts(specs, args.seed + 2)))
            row.steps, row.step_prices = list(recorder.steps), step_prices(recorder.steps, setup) if setup else None
            # not a prediction: the timed pass's own step cost, which tells a price that was off from a schedule
            row.run_pace = step_pace(row.steps, setup) if setup else None
            for pool, p in (row.step_prices or {}).items():
                cost = f"{p['ratio_p50']:.2f}x the plan's price (p50; p90 {p['ratio_p90']:.2f}x)"
                log(f"  {pool}: {p['steps']} steps at {cost}, batches up to {p['largest_batch']}")
                if q := p.get("prompt_steps"):
                    at = f"{q['time_ratio']:.2f}x in time ({q['ratio_p50']:.2f}x p50)"
                    log(f"    {q['steps']} with prompt tokens: {at}")
                if g := p.get("loop_gap"):
                    share = f"{g['gap_share']:.0%} of the steps' own time"
                    batches = g["gap_ms_p50_by_batch"]
                    log(f"    between steps: {g['gap_ms_p50']:.1f} ms p50 ({share}), p50 by batch {batches}")
    except Exception as e:  # noqa: BLE001 - one candidate failing leaves the others' figures
        row.error = f"{type(e).__name__}: {e}"
        log(f"  failed: {row.error}")
        return row
    m = result.metrics
    row.measured = judge(result.records, m, slos, c.workers)
    row.requests = per_request(s.records, result.records)
    row.metrics = {
        "ttft_p90_ms": m.ttft_ms.p90,
        "tpot_p90_ms": m.tpot_ms.p90,
        "stall_p90_ms": m.stall_ms.p90,
        "output_tokens_per_s": m.output_throughput,
        "completed": m.completed,
        "failed": m.failed,
    }
    got, want = row.measured.goodput_per_worker, row.predicted.goodput_per_worker
    log(f"  measured goodput/worker {got:.3f}/s (predicted {want:.3f})")
    if setup and row.run_pace:
        again = score(c, priced_at(setup, *row.run_pace.paces()), specs, slos, args.max_num_seqs)
        row.run_paced = Judged(again.attainment, again.meets, again.goodput_per_worker)
    if at_pace and paced:
        row.pace_ratio, row.pace_decode_ratio = kp, kd = paced.paces()
        row.pace_basis, row.pace_matched_steps = "serving", paced.prompt_steps + paced.decode_steps
        again = score(c, priced_at(at_pace, kp, kd), specs, slos, args.max_num_seqs)
        row.pace_adjusted = Judged(again.attainment, again.meets, again.goodput_per_worker)
        log(f"  at this server's pace: predicted goodput/worker {again.goodput_per_worker:.3f}/s")
    return row


def settle(limit_s: float, quiet: float = QUIET_LOAD) -> None:
    """Wait (up to `limit_s`) for the one-minute load average to fall under `quiet`: a candidate is
    measured on a quiet machine, not in the wake of the one before it."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        load = load_average()
        if load is None or load[0] < quiet:
            return
        time.sleep(3.0)


def fresh_prompts(specs: list[RequestSpec], seed: int) -> list[RequestSpec]:
    """The same schedule and lengths with new random token ids (a trace's prompts are placeholders,
    and a preset's own prompts would be prefix-cache hits on a second pass). Requests that share a
    prefix still do, with new ids: each pass starts with none of its prefixes cached, as the plan
    simulates it."""
    rng = random.Random(seed)
    draw = lambda n: tuple(rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n))  # noqa: E731
    longest: dict[str, int] = {}
    for s in specs:
        if s.prefix_id is not None:
            longest[s.prefix_id] = max(longest.get(s.prefix_id, 0), s.prefix_len)
    prefixes = {k: draw(n) for k, n in sorted(longest.items())}
    out = []
    for s in specs:
        shared = prefixes[s.prefix_id][: s.prefix_len] if s.prefix_id is not None else ()
        out.append(replace(s, prompt=shared + draw(s.prompt_len - len(shared))))
    return out


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
