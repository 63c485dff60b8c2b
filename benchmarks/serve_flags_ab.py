"""A/B of `pdserve serve` flags on a plan's workload: one candidate of `pdserve plan` deployed
under each set of flags, measured as `pdserve plan --verify` measures a candidate (a fresh server
started at a quiet load, the workload twice as warm-up, the timed pass, its workers' steps
against the plan's prices), in rounds whose order alternates (A B C, then C B A).

    python -m benchmarks.serve_flags_ab --calibration PROBE.calibration.json \\
        --model smollm2-135m-instruct --workers 1 <pdserve plan's workload and SLO flags> \\
        --candidate colocated --variant "" --variant "--prompt-threads 1" --rounds 2

Why a tool of its own: the plan prices the defaults, and a flag's worth on a workload (a thread
count, a threshold) is a measured question, asked of the same servers, load and client that
verify the plan. Each variant's row gives its goodput per worker, p90s and attainment per round,
and its prompt steps by length and thread count against the price of the plan's candidate
(`prompt_steps_by_tokens`): one variant's time ratio over another's, bucket by bucket, is what
the flag did to those steps. Writes one JSON (provenance included) and prints one table.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
from dataclasses import fields
from typing import Any

from benchmarks.compare.modes import ensure_ray
from benchmarks.plan_verify import add_arguments as add_plan_arguments
from benchmarks.plan_verify import log, settle, verify_one
from benchmarks.prompt_threads import host_threads
from benchmarks.verify_rows import VerifyRow
from cli import CliError
from costmodel import plan_cli
from costmodel.provenance import write_result


def parse_variant(text: str) -> dict[str, Any]:
    """`pdserve serve` flags (as typed) -> the ServeConfig settings they give (only those given)."""
    from router.config import ServeConfig  # noqa: PLC0415 (starts nothing)
    from router.serve_cli import add_arguments  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="variant", add_help=False)
    add_arguments(p)
    try:
        ns = p.parse_args(shlex.split(text))
    except SystemExit:
        raise CliError(f"--variant {text!r}: not pdserve serve flags") from None
    return {f.name: v for f in fields(ServeConfig) if (v := getattr(ns, f.name, None)) is not None}


def summarize_variant(flags: str, rows: list[VerifyRow]) -> dict[str, Any]:
    """A variant's rounds, and their means."""
    done = [r for r in rows if r.measured is not None]
    good = [r.measured.goodput_per_worker for r in done if r.measured]
    mean = lambda k: statistics.fmean(r.metrics[k] for r in done) if done else None  # noqa: E731
    return {
        "flags": flags,
        "goodput_per_worker": statistics.fmean(good) if good else None,
        "goodput_per_worker_rounds": good,
        "ttft_p90_ms": mean("ttft_p90_ms"),
        "tpot_p90_ms": mean("tpot_p90_ms"),
        "errors": [r.error for r in rows if r.error],
        "rounds": [r.to_dict() for r in rows],
    }


def table(variants: list[dict[str, Any]]) -> str:
    lines = [f"{'variant':<40} {'goodput/worker':>15} {'rounds':>18} {'TTFT p90':>9} {'TPOT p90':>9}"]
    for v in variants:
        g = v["goodput_per_worker"]
        rounds = " ".join(f"{x:.2f}" for x in v["goodput_per_worker_rounds"])
        ttft, tpot = v["ttft_p90_ms"], v["tpot_p90_ms"]
        lines.append(
            f"{v['flags'] or '(defaults)':<40} {g if g is None else f'{g:.3f}/s':>15} {rounds:>18} "
            f"{'-' if ttft is None else f'{ttft:.0f} ms':>9} {'-' if tpot is None else f'{tpot:.0f} ms':>9}"
        )
    lines.append("measured on this machine (each round a fresh server); goodput per worker under the plan's SLOs")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_flags_ab", description=__doc__.split("\n\n")[0])
    add_plan_arguments(p)
    p.add_argument("--candidate", default=None, help="the plan's candidate to deploy, by label (default: its winner)")
    p.add_argument(
        "--variant",
        action="append",
        default=None,
        metavar="FLAGS",
        help='pdserve serve flags on top of the candidate\'s, quoted ("" = its own); give two or more',
    )
    p.add_argument("--rounds", type=int, default=2, help="rounds, in alternating order (default 2)")
    args = p.parse_args(argv)
    texts = args.variant or []
    if len(texts) < 2 or not 1 <= args.rounds <= 4:
        raise CliError("give --variant at least twice, and --rounds 1-4")
    variants = [parse_variant(t) for t in texts]
    plan = plan_cli.make_plan(args, None, [], host_threads(args.workers))
    want = args.candidate or plan.ranked[0].candidate.label
    s = next((x for x in plan.ranked if x.candidate.label == want), None)
    if s is None:
        raise CliError(f"--candidate {want!r}: not a candidate of this plan ({plan.ranked[0].candidate.label}, ...)")
    setup = plan.setup_of(s.candidate)
    ensure_ray()
    rows: dict[int, list[VerifyRow]] = {i: [] for i in range(len(texts))}
    for rnd in range(args.rounds):
        order = list(range(len(texts)))
        for i in order if rnd % 2 == 0 else order[::-1]:
            settle(args.settle_s)
            log(f"[round {rnd + 1}] {want} {texts[i] or '(defaults)'}")
            rank = plan.ranked.index(s) + 1
            rows[i].append(verify_one(s, rank, plan.specs, plan.slos, args, setup, None, variants[i]))
    out = [summarize_variant(texts[i], rows[i]) for i in range(len(texts))]
    doc = {"candidate": want, "predicted": s.to_dict(), "workload": plan.doc.get("workload"), "variants": out}
    config = {k: v for k, v in vars(args).items() if k not in ("json", "func", "handler")}
    path = write_result(args.out or "serve-flags-ab", doc, config=config, out_dir=args.out_dir)
    print(table(out))
    print(f"\nresult: {path}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except CliError as e:
        raise SystemExit(f"error: {e}") from None
