"""`pdserve plan --reprice RESULT`: a `--verify` result's measured rows predicted again by the
code as it is now, without deploying anything.

A verification keeps each candidate's measured figures and the steps its workers logged: the
serving pace's before the timed pass (`pace_steps`) and the timed pass's own (`steps`). This
rebuilds the plan from the result's own flags (its provenance) and, for each measured round,
gives the goodput and attainment the current simulator predicts three ways: plain (the
calibration's prices), at the pace read before the pass (what `--verify` would predict now), and
at the timed pass's own steps (after the fact, not a prediction: what is left of that error is the
schedule's, not the step prices'). A change to the simulator or to how a pace is read can then be
judged on every run kept, and the figure quoted with this command beside it.

The calibration is found where the result names it, else beside the result (a result read on
another clone); `--calibration FILE` given beside `--reprice` judges another calibration on the
same measured runs (the "kept" column stays the result's own prediction). Nothing here is
measured; a round's steps are as the result kept them (results from before 2026-12-06 23:03 UTC
kept the burst's own prompts among the pace steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.client.logged_step import from_table
from benchmarks.plan_calibration import compare_fits
from benchmarks.prompt_threads import host_threads
from benchmarks.verify_steps import step_pace
from cli import CliError
from cli.output import emit_json
from costmodel import plan_cli
from costmodel.plan.score import Judged, Scored, Slos, goodput_interval, priced_at, score, share_within
from costmodel.serve_metrics import percentile

# the plan flags a result's provenance carries that `--reprice` takes from it (everything but how
# the verification ran and where it wrote)
_NOT_PLAN_FLAGS = {"command", "verify", "repeats", "reprice", "out", "out_dir", "json", "_main"}
WITHIN_GOODPUT, WITHIN_POINTS = 0.10, 5.0  # issue 42's per-candidate targets


def add_argument(group: Any) -> None:
    """`--reprice` in `pdserve plan`'s verification flags (benchmarks/plan_verify.py)."""
    group.add_argument(
        "--reprice",
        default=None,
        metavar="RESULT|DIR",
        help="deploy nothing: predict a `--verify` result's measured rows again with the code as it is now, "
        "from the result's own flags and the steps it kept; with --calibration another calibration, with "
        "--slo-ttft-ms/--slo-tpot-ms other SLOs, judged on the same measured runs (benchmarks/plan_reprice.py). "
        "A folder: every `--verify` result in it, each at its own flags, and the accuracy over all of them "
        "by the plan's own miss risk (benchmarks/plan_reprice_all.py)",
    )


@dataclass(frozen=True)
class Repriced:
    """One measured round of one candidate, predicted again now."""

    label: str
    round: int  # 1-based; 1 where the verification measured once
    measured: Judged
    kept: Judged | None  # the prediction the result recorded when it ran (None: judged at other SLOs now)
    plain: Judged  # now, at the calibration's prices
    at_pace: Judged | None  # now, at the pace its server's steps read before the timed pass
    at_run: Judged | None  # now, at the timed pass's own steps (after the fact)
    pace: tuple[float, float] | None  # (prompt, decode) paces read before the pass
    run_pace: tuple[float, float] | None
    # way ("measured", "plain", "at_pace", "at_run") -> TTFT, TPOT and stall p90 in ms: an edge
    # candidate's miss is read from these (attainment says how many requests, not by how much)
    p90_ms: dict[str, dict[str, float | None] | None] = field(default_factory=dict)
    # the plan's chance now that the candidate misses an SLO at its price error (costmodel/plan/risk.py);
    # None outside the top candidates it prices an interval for: tells an SLO's edge from the rest
    miss_risk: float | None = None
    # the plan's goodput interval now (its figures with every step priced its price error lower and
    # higher); None where it prices none: issue 42's target re-set for an SLO's edge is the
    # measured goodput inside it
    goodput_interval: tuple[float, float] | None = None

    def inside_interval(self) -> bool | None:
        """Whether the measured goodput lies in the plan's interval (None: no interval)."""
        if self.goodput_interval is None:
            return None
        lo, hi = self.goodput_interval
        return lo <= self.measured.goodput_per_worker <= hi

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"label": self.label, "round": self.round}
        for name in ("measured", "kept", "plain", "at_pace", "at_run"):
            j = getattr(self, name)
            out[name] = j.to_dict() if j else None
        out |= {"pace": self.pace, "run_pace": self.run_pace, "p90_ms": self.p90_ms, "miss_risk": self.miss_risk}
        out["goodput_interval"] = self.goodput_interval
        return out


def plan_args(
    result: dict[str, Any], path: Path, defaults: argparse.Namespace, calibration: str | None = None
) -> argparse.Namespace:
    """The plan's flags as the result ran them, over today's defaults; the calibration beside the
    result where the path it names is not here, or `calibration` instead (another fit judged on the
    same measured runs)."""
    config = dict((result.get("provenance") or {}).get("config") or {})
    if not config:
        raise CliError(f"--reprice {path}: no provenance config (not a `pdserve plan --verify` result)")
    args = argparse.Namespace(**vars(defaults))
    for k, v in config.items():
        if k not in _NOT_PLAN_FLAGS and hasattr(args, k):
            setattr(args, k, v)
    if calibration:
        args.calibration, args.gpu = calibration, None
    elif args.calibration:
        found = []
        for c in str(args.calibration).split(","):
            here = Path(c) if Path(c).exists() else path.parent / Path(c).name
            if not here.exists():
                raise CliError(f"--reprice {path}: its calibration {c} is not here, nor beside the result")
            found.append(str(here))
        args.calibration = ",".join(found)
    return args


def reprice(result: dict[str, Any], args: argparse.Namespace, ran: Slos | None = None) -> list[Repriced]:
    """Every measured round of the result's verification, predicted again by the current code; where
    `args` asks for other SLOs than the result ran with (`ran`), its measured requests judged again at
    them (`rejudged`)."""
    by_kind = compare_fits(args)
    plan = plan_cli.make_plan(args, by_kind, [], None if by_kind else host_threads(args.workers))
    ranked = {s.candidate.label: s for s in plan.ranked}
    out = []
    for row in (result.get("verification") or {}).get("rows") or []:
        s = ranked.get(row["label"])
        if s is None:
            log(f"{row['label']}: not among the plan's candidates now; left out")
            continue
        for i, rnd in enumerate(row.get("rounds") or [row], start=1):
            if not rnd.get("measured"):
                continue
            measured: Judged = _from_dict(rnd["measured"])
            kept: Judged | None = _from_dict(rnd["predicted"])  # None once judged at other SLOs
            if ran is not None and ran != plan.slos:
                got = rejudged(rnd, ran, plan.slos)
                if got is None:
                    log(f"{row['label']} round {i}: no request met the SLOs it ran with; its duration is not known")
                    continue
                measured, kept = got, None
            out.append(_one(s, rnd, i, plan, args, measured, kept))
    return out


def rejudged(rnd: dict[str, Any], ran: Slos, now: Slos) -> Judged | None:
    """A round's measured requests (its kept TTFT and TPOT each) judged at the SLOs `now` instead
    of those it `ran` with: attainment, p90s within them, goodput per worker, the run's duration
    and workers read back from its goodput then (requests met / goodput). Measured figures, judged
    again; the stall is not kept per document (a stall SLO is not re-judged). None where no request
    met the SLOs it ran with (nothing to read the duration from)."""
    reqs = rnd.get("requests") or []
    ttft = [v for r in reqs if (v := r["ttft_ms"][1]) is not None]
    tpot = [v for r in reqs if (v := r["tpot_ms"][1]) is not None]

    def met(slos: Slos) -> int:
        within = lambda v, lim: lim is None or v is None or v <= lim  # noqa: E731
        return sum(within(r["ttft_ms"][1], slos.ttft_ms) and within(r["tpot_ms"][1], slos.tpot_ms) for r in reqs)

    then = float(rnd["measured"]["goodput_per_worker"])
    if not reqs or met(ran) == 0 or then <= 0:
        return None
    p90_within = lambda vals, lim: lim is None or not vals or (percentile(vals, 90) or 0.0) <= lim  # noqa: E731
    att = {"ttft": share_within(ttft, now.ttft_ms), "tpot": share_within(tpot, now.tpot_ms), "stall": None}
    meets = p90_within(ttft, now.ttft_ms) and p90_within(tpot, now.tpot_ms)
    return Judged(att, meets, met(now) * then / met(ran))


def _one(
    s: Scored, rnd: dict[str, Any], i: int, plan: plan_cli.Plan, args: argparse.Namespace,
    measured: Judged, kept: Judged | None,
) -> Repriced:  # fmt: skip
    setup = plan.setup_of(s.candidate)

    p90: dict[str, dict[str, float | None] | None] = {"measured": _measured_p90s(rnd), "plain": _p90s(s)}

    def again(way: str, steps: dict[str, Any] | None) -> tuple[Judged | None, tuple[float, float] | None]:
        paced = step_pace(from_table(steps), setup)
        if paced is None:
            p90[way] = None
            return None, None
        kp, kd = paced.paces()
        sc = score(s.candidate, priced_at(setup, kp, kd), plan.specs, plan.slos, args.max_num_seqs)
        p90[way] = _p90s(sc)
        return _judged(sc), (kp, kd)

    at_pace, pace = again("at_pace", rnd.get("pace_steps"))
    at_run, run_pace = again("at_run", rnd.get("steps"))
    risk = s.risk.miss_chance if s.risk else None
    return Repriced(
        s.candidate.label, i, measured, kept, _judged(s), at_pace, at_run, pace, run_pace, p90, risk,
        goodput_interval(s),
    )  # fmt: skip


_P90_KEYS = ("ttft_p90_ms", "tpot_p90_ms", "stall_p90_ms")


def _p90s(s: Scored) -> dict[str, float | None]:
    m = s.metrics
    return dict(zip(_P90_KEYS, (m.ttft_ms.p90, m.tpot_ms.p90, m.stall_ms.p90)))


def _measured_p90s(rnd: dict[str, Any]) -> dict[str, float | None] | None:
    """The round's measured p90s, where the result kept its metrics (results since 2026-11)."""
    mm = rnd.get("measured_metrics")
    return {k: mm.get(k) for k in _P90_KEYS} if mm else None


def _judged(s: Scored) -> Judged:
    return Judged(s.attainment, s.meets, s.goodput_per_worker)


def _from_dict(d: dict[str, Any]) -> Judged:
    return Judged(dict(d["attainment"]), bool(d["meets_slos"]), float(d["goodput_per_worker"]))


def goodput_error(p: Judged | None, m: Judged) -> float | None:
    """(predicted - measured) / measured; None where either is missing or nothing was measured good."""
    if p is None or m.goodput_per_worker <= 0:
        return None
    return (p.goodput_per_worker - m.goodput_per_worker) / m.goodput_per_worker


def attainment_points(p: Judged | None, m: Judged) -> float | None:
    """The largest attainment error over the SLOs given, in percentage points."""
    if p is None:
        return None
    pts = [
        abs(a - b) * 100 for k, a in p.attainment.items() if a is not None and (b := m.attainment.get(k)) is not None
    ]
    return max(pts) if pts else None


def summary(rows: list[Repriced]) -> dict[str, Any]:
    """Per way of predicting: rounds within issue 42's targets (goodput 10%, attainment 5 points)."""
    out: dict[str, Any] = {"rounds": len(rows)}
    for name in ("kept", "plain", "at_pace", "at_run"):
        g = [e for r in rows if (e := goodput_error(getattr(r, name), r.measured)) is not None]
        a = [e for r in rows if (e := attainment_points(getattr(r, name), r.measured)) is not None]
        out[name] = {
            "goodput_within_10pct": sum(abs(e) <= WITHIN_GOODPUT for e in g), "goodput_rows": len(g),
            "goodput_error_median_abs": statistics.median(abs(e) for e in g) if g else None,
            "attainment_within_5pts": sum(e <= WITHIN_POINTS for e in a), "attainment_rows": len(a),
        }  # fmt: skip
    return out


def format_table(rows: list[Repriced], totals: dict[str, Any]) -> str:
    head = ["candidate", "round", "measured", "kept", "now", "at pace now", "at run now (after)", "paces p/d"]
    out = [head]
    for r in rows:
        m = r.measured
        cell = lambda j: "-" if j is None else f"{j.goodput_per_worker:.3f} {_err(goodput_error(j, m))}"  # noqa: E731
        paces = "/".join(f"{x:.2f}" for x in r.pace) if r.pace else "-"
        run = "/".join(f"{x:.2f}" for x in r.run_pace) if r.run_pace else "-"
        out.append([r.label, str(r.round), f"{m.goodput_per_worker:.3f}", cell(r.kept), cell(r.plain),
                    cell(r.at_pace), cell(r.at_run), f"{paces} then {run}"])  # fmt: skip
    widths = [max(len(row[i]) for row in out) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in out
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    tail = [
        f"{name}: goodput within 10% for {t['goodput_within_10pct']} of {t['goodput_rows']} "
        f"(median |error| {_pct(t['goodput_error_median_abs'])}), attainment within 5 points for "
        f"{t['attainment_within_5pts']} of {t['attainment_rows']}"
        for name, t in ((n, totals[n]) for n in ("kept", "plain", "at_pace", "at_run"))
    ]
    return (
        "goodput per worker, measured beside predicted (error against measured); nothing here is measured anew\n"
        + "\n".join(lines) + "\n" + "\n".join(tail)
    )  # fmt: skip


def _err(e: float | None) -> str:
    return "" if e is None else f"({e:+.0%})"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def main(args: argparse.Namespace, defaults: argparse.Namespace) -> int:
    """`defaults`: the plan's flags as a bare `pdserve plan` parses them (a result's own override them)."""
    if args.slo_stall_ms is not None:
        raise CliError("--reprice judges measured requests again at other TTFT and TPOT SLOs, not a stall's")
    path = Path(args.reprice)
    slos = (args.slo_ttft_ms, args.slo_tpot_ms)
    planned, ran, rows = reprice_file(path, defaults, args.calibration, slos)
    totals = summary(rows)
    if args.json:
        doc = {"result": str(path), "calibration": planned.calibration, "gpu": planned.gpu, "slos_ran": ran.as_dict()}
        doc["slos"] = Slos(planned.slo_ttft_ms, planned.slo_tpot_ms, planned.slo_stall_ms).as_dict()
        emit_json({**doc, "rounds": [r.to_dict() for r in rows], "summary": totals})
    else:
        print(format_table(rows, totals))
    return 0


def reprice_file(
    path: Path,
    defaults: argparse.Namespace,
    calibration: str | None = None,
    slos: tuple[float | None, float | None] = (None, None),
    result: dict[str, Any] | None = None,
) -> tuple[argparse.Namespace, Slos, list[Repriced]]:
    """One `--verify` result's rounds predicted again: the plan's flags it ran with (over `defaults`),
    the SLOs it ran at, and its rows. `calibration`: another fit judged on the same runs; `slos`:
    TTFT and TPOT p90 limits (ms) to judge its measured requests at instead (None: as it ran);
    `result`: the file's document where the caller has read it already."""
    if result is None:
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CliError(f"--reprice {path}: {e}") from e
    if not (result.get("verification") or {}).get("rows"):
        raise CliError(f"--reprice {path}: no verified rows (a `pdserve plan --verify K` result has them)")
    planned = plan_args(result, path, defaults, calibration)
    ran = Slos(planned.slo_ttft_ms, planned.slo_tpot_ms, planned.slo_stall_ms)
    for k, v in zip(("slo_ttft_ms", "slo_tpot_ms"), slos):  # given beside --reprice: the same runs judged at them
        if v is not None:
            setattr(planned, k, v)
    return planned, ran, reprice(result, planned, ran)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
