"""`pdserve plan`: from a calibration and a workload with SLOs, the deployment to run.

Every deployment a worker budget allows (costmodel/plan/candidates.py) is simulated on one device
model: a calibration file (`bench chunks`, `bench probe` of any server, or a `bench compare`
self-calibration) or a GPU datasheet (`--gpu`, predicted only), and ranked by goodput per worker
under the SLOs (costmodel/plan/score.py). It prints one table, the winner's `pdserve serve`
command and why it wins. Nothing here is measured: `--verify K` (benchmarks/plan_verify.py, the
command's entry point, which adds the flag) deploys the top candidates and measures them.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli import CliError
from cli.output import emit_json
from costmodel.article import cost_model as cm
from costmodel.plan.candidates import DEFAULT_CHUNKS, Candidate, enumerate_candidates
from costmodel.plan.pricing import ThreadedWhole, computed_prompt_tokens, coverage_notes, setup_for, threaded_whole
from costmodel.plan.report import explain, format_table
from costmodel.plan.risk import rank_by_risk
from costmodel.plan.score import Scored, Slos, fit_error, interval, rank, score, simpler_first
from costmodel.plan.trace import read_trace
from costmodel.sim import compare_predict as cp
from costmodel.sim.model import StepModel
from costmodel.workloads import RequestSpec, WorkloadConfig, workload_specs

MAX_LOSS = 0.2  # see costmodel/plan/risk.py: soft cliffs (8.5% expected loss) pass, hard ones (36%) do not
# The sd of the step prices verified deployments ran at, over their calibration's (30 pools, two VMs,
# 2026-12-05: 0.96-1.31x, mean 1.115, sd 0.10): the machine moves between calibrating and deploying.
# Re-read 2026-12-07 from the 127 timed passes that kept their steps (`pdserve plan --reprice
# benchmarks/results/plan-verify --json`, run_pace): sd of log pace 0.10 for prompt steps, 0.13 for
# decode steps (10th-90th percentile 0.91-1.16x and 0.87-1.20x); left at 0.10.
PRICE_DRIFT = 0.10
INTERVAL_TOP = 5  # candidates simulated again at their price error either way

# The presets: the WorkloadConfig fields each sets (--rate/--isl/--osl/--num-requests override them)
_RANDOM = ("num_requests", "request_rate", "random_input_len", "random_output_len", "random_range_ratio")
_ARTICLE = ("chat_streams", "chat_prompt_len", "chat_output_len", "doc_prompt_len", "doc_output_len", "doc_count")


def _random(*values: float) -> dict[str, Any]:
    """A preset of random lengths, its numbers in `_RANDOM`'s order (Poisson arrivals)."""
    return {"workload": "random", **dict(zip(_RANDOM, values))}


def _article(*values: float, **more: float) -> dict[str, Any]:
    """A preset of the article's mix, its numbers in `_ARTICLE`'s order (documents from 1 s)."""
    return {"workload": "article", "doc_start_s": 1.0, **dict(zip(_ARTICLE, values)), **more}


WORKLOADS: dict[str, dict[str, Any]] = {
    "article": _article(8, 64, 256, 2048, 8, 3, doc_interval_s=1.5),
    "chat": _random(64, 4.0, 256, 128, 0.5),
    "rag": _random(48, 2.0, 2048, 64, 0.25),
    "mixed": _article(8, 64, 256, 2048, 8, 6, doc_rate=0.5),
}
WORKLOAD_HELP = (
    "article: 8 chats decoding while three 2048-token documents arrive; chat: short prompts, long answers; "
    "rag: long retrieved prompts, short answers (both Poisson); mixed: the article's chats with documents "
    "arriving as a Poisson process"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = (
        "examples: pdserve plan --calibration benchmarks/results/chunks-smollm2-135m-instruct-cpu.calibration.json "
        "--model smollm2-135m-instruct --workers 2 --slo-stall-ms 500;  "
        "pdserve plan --gpu h100 --model llama-3.1-70b --workers 8 --workload article --slo-ttft-ms 2000"
    )
    g = p.add_argument_group("the device model (one of)")
    g.add_argument(
        "--calibration",
        help="calibration JSON (`bench chunks`, `bench probe`), or `bench compare` results (comma-separated, "
        "e.g. one run of 1-worker servers and one of `--decode 2`): each candidate is then priced by the fit "
        "to the server of its kind (colocated, chunked, disagg) and worker count",
    )
    g.add_argument("--gpu", help=f"price from a datasheet instead (predicted only): {', '.join(sorted(cm.HARDWARE))}")
    g.add_argument(
        "--model",
        default=None,
        help="model preset, checkpoint dir or config.json (its shapes; required but with --reprice)",
    )
    g.add_argument(
        "--link",
        default=None,
        help=f"the KV link between pools: {', '.join(cm.LINKS)} (default: the calibration's, else ib-400g)",
    )
    w = p.add_argument_group("the workload")
    w.add_argument("--workload", choices=sorted(WORKLOADS), default="article", help=WORKLOAD_HELP)
    w.add_argument("--num-requests", type=int, default=None, help="chat/rag: requests in the workload")
    w.add_argument("--rate", type=float, default=None, help="chat/rag: requests/s; mixed: documents/s (Poisson)")
    w.add_argument("--isl", type=int, default=None, help="chat/rag: mean prompt tokens; article/mixed: document tokens")
    w.add_argument("--osl", type=int, default=None, help="chat/rag: output tokens; article/mixed: a chat's output")
    w.add_argument(
        "--prefix-share",
        type=float,
        default=None,
        help="chat/rag: the share of each prompt that is a prefix shared with other requests (a system "
        "prompt; 0-0.99), cached by the server and modelled so (default 0)",
    )
    w.add_argument(
        "--prefixes", type=int, default=None, help="with --prefix-share: how many distinct shared prefixes (default 1)"
    )
    w.add_argument("--seed", type=int, default=0)
    w.add_argument(
        "--trace",
        default=None,
        help="JSONL requests instead of a preset: arrival_s, prompt_tokens, output_tokens (kind, prefix_id optional)",
    )
    s = p.add_argument_group("SLOs (p90, each optional)")
    s.add_argument("--slo-ttft-ms", type=float, default=None)
    s.add_argument("--slo-tpot-ms", type=float, default=None)
    s.add_argument("--slo-stall-ms", type=float, default=None, help="longest gap a document puts in the streams")
    s.add_argument(
        "--max-loss",
        type=float,
        default=MAX_LOSS,
        help="the largest share of its goodput a candidate may expect to lose to SLO misses, with steps priced "
        f"at its fit's error and the machine's drift, and still rank with those that hold (default {MAX_LOSS}; 1 "
        "ranks by expected goodput alone)",
    )
    s.add_argument(
        "--max-risk",
        type=float,
        default=1.0,
        help="also rank after those that hold any candidate whose chance of missing an SLO at that error is above "
        "this (default 1: off; set it where an SLO is a contract, e.g. 0.1)",
    )
    s.add_argument(
        "--price-drift",
        type=float,
        default=PRICE_DRIFT,
        help="how far the machine's step prices may move between calibrating and deploying, beside each fit's own "
        f"error (added in quadrature; default {PRICE_DRIFT}: verified deployments on the dev VMs ran their steps at "
        "0.96-1.31x the calibration's price)",
    )
    b = p.add_argument_group("the budget")
    b.add_argument(
        "--workers", type=int, default=2, help="the most workers (GPUs) to deploy; fewer compete too (default 2)"
    )
    b.add_argument(
        "--chunk-sizes",
        default=",".join(map(str, DEFAULT_CHUNKS)),
        help="chunk sizes to try (those below the longest prompt)",
    )
    b.add_argument("--max-num-seqs", type=int, default=64, help="decode batch limit per worker (default 64)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")


@dataclass
class Plan:
    """What `pdserve plan` decided, for printing and for `--verify` (benchmarks/plan_verify.py)."""

    doc: dict[str, Any]  # the --json document
    ranked: list[Scored]  # best first
    specs: list[RequestSpec]  # the workload's requests
    slos: Slos
    setup: cp.PredictionSetup
    command: list[str]  # the winner's `pdserve serve`
    why: str
    note: str | None
    elapsed_s: float
    by_kind: Mapping[str, cp.PredictionSetup] | None = None
    whole: ThreadedWhole | None = None

    def setup_of(self, c: Candidate) -> cp.PredictionSetup:
        """The device model that priced `c` (`--verify` re-prices it at the pace it measures)."""
        return setup_for(c, self.by_kind, self.setup, self.whole)


def make_plan(
    args: argparse.Namespace,
    by_kind: Mapping[str, cp.PredictionSetup] | None = None,
    notes: Sequence[str] = (),
    host_threads: Mapping[int, tuple[int, int]] | None = None,
) -> Plan:
    """Every candidate simulated, ranked and explained (raises CliError on bad flags). `by_kind`:
    a device model per deployment kind ("colocated", "chunked", "disagg": a `bench compare`
    result's fits to each of its servers, benchmarks/plan_verify.py reads them); a candidate of a
    kind it lacks is priced by the colocated one (else the first). `host_threads`: workers ->
    (decode, prompt) threads of a colocated whole deployment on this host (pricing.threaded_whole)."""
    t0 = time.perf_counter()
    if by_kind:
        _check_flags(args)
        setup = by_kind.get("colocated") or next(iter(by_kind.values()))
    else:
        setup = _setup(args)
    specs, note = _requests(args)
    whole = None if by_kind else threaded_whole(setup, host_threads, computed_prompt_tokens(specs))
    setup_of = lambda c: setup_for(c, by_kind, setup, whole)  # noqa: E731
    for extra in notes:  # the caller's (benchmarks/plan_verify.py: a calibration from another CPU)
        note = f"{note}; {extra}" if note else extra
    try:
        chunks = [int(x) for x in args.chunk_sizes.split(",") if x.strip()]
        shared = any(s.prefix_id is not None for s in specs)
        # --mode auto's router needs a step fit to start from: a calibration file's (not a bench
        # compare result's fits, nor a datasheet's prices)
        auto = args.calibration if args.calibration and not by_kind and setup.steps.fit is not None else None
        slos_ms = (args.slo_ttft_ms, args.slo_tpot_ms) if auto else None
        longest = max(s.prompt_len for s in specs)
        cands = enumerate_candidates(args.workers, chunks, longest, shared, slos_ms, auto)
    except ValueError as e:
        raise CliError(f"--chunk-sizes/--workers: {e}") from None
    slos = Slos(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_stall_ms)
    ranked = rank([score(c, setup_of(c), specs, slos, args.max_num_seqs) for c in cands])
    errs = [e for e in map(fit_error, [setup, *(by_kind or {}).values()]) if e]
    err = max(errs, default=None)
    if err:  # the top candidates again at their own fit's error either way: is the choice a toss-up?
        # (each its own: the largest of every fit the plan holds, a noisy fit to two contending
        # workers, put 23% on a one-worker candidate whose own fit read 4.6%, and ranked it out)
        for s in ranked[:INTERVAL_TOP]:
            own = fit_error(setup_of(s.candidate))
            s.price_error = math.hypot(own, args.price_drift) if own is not None else None
            if s.price_error:
                s.interval = interval(s, setup_of(s.candidate), specs, slos, args.max_num_seqs, s.price_error)
        ranked = rank_by_risk(ranked, slos, INTERVAL_TOP, args.max_loss, args.max_risk)
    ranked = simpler_first(ranked)
    for extra in coverage_notes(ranked, cands, specs, setup, by_kind, whole):
        note = f"{note}; {extra}" if note else extra
    elapsed = time.perf_counter() - t0
    winner = ranked[0]
    command = ["pdserve", "serve", "--model", args.model, *winner.candidate.serve_args()]
    why = explain(ranked, setup_of(winner.candidate), specs, err, args.max_loss, args.max_risk)
    doc = {
        "predicted": True,
        "device_model": {
            "source": setup.source,
            "kind": setup.kind,
            "link": setup.link.label,
            "fit_error": err,
            "by_kind": {k: s.source for k, s in by_kind.items()} if by_kind else None,
            "whole_prompt_threads": {
                "workers": sorted(whole.workers),
                "threads": whole.threads,
                "speedup": whole.speedup,
                "at_prompt_tokens": whole.prompt_tokens,
            }
            if whole
            else None,
        },
        "workload": {
            "preset": None if args.trace else args.workload,
            "trace": args.trace,
            "requests": len(specs),
            **_workload_summary(specs),
            "note": note,
        },
        "slos": slos.as_dict(),
        "budget": {"workers": args.workers, "max_num_seqs": args.max_num_seqs},
        "candidates": [s.to_dict() for s in ranked],
        "winner": winner.candidate.label,
        "serve_command": " ".join(command),
        "why": why,
        "seconds": elapsed,
    }
    return Plan(doc, ranked, specs, slos, setup, command, why, note, elapsed, by_kind, whole)


def print_plan(plan: Plan) -> None:
    print(format_table(plan.ranked))
    print(f"\nplan: {plan.ranked[0].candidate.label}\n  {' '.join(plan.command)}\n  {plan.why}")
    if plan.note:
        print(f"  note: {plan.note}")
    print(
        f"\n{len(plan.ranked)} candidates simulated in {plan.elapsed_s:.1f} s on {_source(plan)}. Every figure is "
        "predicted by the simulator, none measured: `--verify K` deploys the top K on this machine."
    )


def _source(plan: Plan) -> str:
    by_kind = plan.doc["device_model"].get("by_kind")
    return "; ".join(f"{k} candidates: {v}" for k, v in by_kind.items()) if by_kind else plan.setup.source


def main(
    args: argparse.Namespace,
    by_kind: Mapping[str, cp.PredictionSetup] | None = None,
    notes: Sequence[str] = (),
    host_threads: Mapping[int, tuple[int, int]] | None = None,
) -> int:
    plan = make_plan(args, by_kind, notes, host_threads)
    if args.json:
        emit_json(plan.doc)
    else:
        print_plan(plan)
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    if not args.model:
        raise CliError("--model is required (the served model: its shapes price the steps)")
    for flag in ("max_num_seqs", "slo_ttft_ms", "slo_tpot_ms", "slo_stall_ms"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise CliError(f"--{flag.replace('_', '-')} must be > 0")
    if not 0 <= args.max_risk <= 1:
        raise CliError("--max-risk must be 0-1 (a chance)")
    if not 0 <= args.price_drift <= 1:
        raise CliError("--price-drift must be 0-1 (a relative error)")
    if not 0 <= args.max_loss <= 1:
        raise CliError("--max-loss must be 0-1 (a share of goodput)")


def _setup(args: argparse.Namespace) -> cp.PredictionSetup:
    _check_flags(args)
    if bool(args.calibration) == bool(args.gpu):
        raise CliError("give one device model: --calibration FILE or --gpu NAME")
    if args.link is not None and args.link not in cm.LINKS:
        raise CliError(f"--link {args.link}: unknown (known: {', '.join(cm.LINKS)})")
    try:
        spec_check = cm.ModelSpec.resolve(args.model)
    except (ValueError, KeyError, FileNotFoundError, OSError) as e:
        raise CliError(f"--model {args.model}: {e}") from None
    if args.calibration:
        if not Path(args.calibration).is_file():
            raise CliError(f"--calibration {args.calibration}: no such file")
        try:
            setup = cp.setup_from_calibration(args.model, Path(args.calibration))
        except (ValueError, KeyError) as e:
            raise CliError(f"--calibration {args.calibration}: {e}") from None
        return setup if args.link is None else _with_link(setup, cm.LINKS[args.link])
    if args.gpu not in cm.HARDWARE:
        raise CliError(f"--gpu {args.gpu}: unknown (known: {', '.join(sorted(cm.HARDWARE))})")
    hw = cm.HARDWARE[args.gpu]
    steps = StepModel(spec_check, hw, cm.ARTICLE_MFU)
    link = cm.LINKS[args.link or "ib-400g"]
    return cp.PredictionSetup(steps, link, f"the {hw.name} datasheet at {cm.ARTICLE_MFU:.0%} MFU", kind="datasheet")


def _with_link(setup: cp.PredictionSetup, link: cm.Link) -> cp.PredictionSetup:
    from dataclasses import replace  # noqa: PLC0415

    return replace(setup, link=link)


def _requests(args: argparse.Namespace) -> tuple[list[RequestSpec], str | None]:
    """The workload's requests (a preset, or --trace), and a note on what the plan leaves out."""
    if not args.trace:
        return workload_specs(_workload(args)), None
    if any(getattr(args, f) is not None for f in ("rate", "isl", "osl", "num_requests", "prefix_share", "prefixes")):
        raise CliError(
            "--trace gives the requests: --rate, --isl, --osl, --num-requests, --prefix-share and --prefixes "
            "do not apply"
        )
    try:
        specs, shared = read_trace(Path(args.trace))
    except OSError as e:
        raise CliError(f"--trace {args.trace}: {e.strerror or e}") from None
    except ValueError as e:
        raise CliError(str(e)) from None
    note = None
    if shared:
        note = f"{shared} requests carry a prefix_id without prefix_tokens: their sharing is not modelled"
    return specs, note


def _workload(args: argparse.Namespace) -> WorkloadConfig:
    fields = WORKLOADS[args.workload]
    kw = dict(fields, seed=args.seed, prompt_token_ids=True)
    article = kw["workload"] == "article"
    for flag, random_field, article_field in (
        ("num_requests", "num_requests", None),
        ("rate", "request_rate", "doc_rate"),
        ("isl", "random_input_len", "doc_prompt_len"),
        ("osl", "random_output_len", "chat_output_len"),
        ("prefix_share", "prefix_share", None),
        ("prefixes", "prefix_count", None),
    ):
        value = getattr(args, flag)
        if value is None:
            continue
        target = article_field if article else random_field
        if target is None:
            raise CliError(f"--{flag.replace('_', '-')} does not apply to --workload {args.workload}")
        kw[target] = value
    return WorkloadConfig(**kw)


def _workload_summary(specs: list[RequestSpec]) -> dict[str, Any]:
    last = max(s.arrival_s for s in specs)
    return {
        "prompt_tokens_mean": sum(s.prompt_len for s in specs) / len(specs),
        "output_tokens_mean": sum(s.max_tokens for s in specs) / len(specs),
        "span_s": last,
    }
