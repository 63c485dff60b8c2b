"""What `pdserve plan --verify` records of each candidate and prints (benchmarks/plan_verify.py
runs them): a row of predicted beside measured, the workers' steps against the plan's prices, the
regret and the worst errors, and the table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.compare.calibrate.calibration import LoggedStep
from costmodel.plan.candidates import Candidate
from costmodel.plan.score import Judged
from costmodel.sim.compare_predict import PredictionSetup


@dataclass
class VerifyRow:
    candidate: Candidate
    rank: int  # in the plan, 1 = the winner
    predicted: Judged
    measured: Judged | None  # None: the server failed to start or the run failed
    metrics: dict[str, Any]  # the measured p90s and throughput
    error: str | None = None
    startup_s: float | None = None
    load_average: list[float] | None = None
    pace: dict[str, Any] | None = None  # the machine's pace before the server started (benchmarks/pace.py)
    # the workers' steps in the timed pass against the prices the plan gave them, per pool
    step_prices: dict[str, Any] | None = None
    # the prediction again with every step priced at the pace measured before this server (the
    # calibration's pace / this one's); None where either pace is unknown
    pace_adjusted: Judged | None = None
    pace_ratio: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.candidate.label,
            "serve_args": self.candidate.serve_args(),
            "plan_rank": self.rank,
            "predicted": self.predicted.to_dict(),
            "measured": self.measured.to_dict() if self.measured else None,
            "measured_metrics": self.metrics,
            "error": self.error,
            "startup_s": self.startup_s,
            "load_average_at_start": self.load_average,
            "machine_pace_at_start": self.pace,
            "step_prices": self.step_prices,
            "pace_ratio": self.pace_ratio,
            "predicted_at_this_pace": self.pace_adjusted.to_dict() if self.pace_adjusted else None,
        }


def step_prices(steps: list[LoggedStep], setup: PredictionSetup) -> dict[str, Any] | None:
    """Per pool: how many steps ran, and what they cost against the plan's price for their shape
    (p50 and p90 of measured / priced), with the most sequences a step decoded. Tells a step
    model that was off from a scheduling model that was (None: a datasheet model prices no shape)."""
    by_pool: dict[str, list[tuple[float, int]]] = {}
    for s in steps:
        f = setup.steps.fit_of(s.role, s.shape.prefill_tokens)
        if f is None:
            return None
        priced = f.seconds(s.shape)
        if priced > 0 and s.seconds > 0:
            by_pool.setdefault(s.role, []).append((s.seconds / priced, s.shape.decode_seqs))
    out = {}
    for pool, xs in by_pool.items():
        ratios = sorted(r for r, _ in xs)
        out[pool] = {
            "steps": len(xs),
            "ratio_p50": ratios[len(ratios) // 2],
            "ratio_p90": ratios[min(len(ratios) - 1, int(0.9 * len(ratios)))],
            "largest_batch": max(b for _, b in xs),
        }
    return out


def summarize(rows: list[VerifyRow], winner: str) -> dict[str, Any]:
    """Regret and the worst prediction errors over the rows measured."""
    done = [r for r in rows if r.measured is not None]
    if not done:
        return {"regret": None, "best_measured": None, "winner": winner}
    best = max(done, key=lambda r: r.measured.goodput_per_worker if r.measured else 0.0)
    chosen = next((r for r in done if r.candidate.label == winner), None)
    best_g = best.measured.goodput_per_worker if best.measured else 0.0
    regret = None
    if chosen is not None and chosen.measured is not None:
        regret = (best_g - chosen.measured.goodput_per_worker) / best_g if best_g > 0 else 0.0
    att_err = [
        abs(p - m)
        for r in done
        if r.measured
        for k in ("ttft", "tpot", "stall")
        if (p := r.predicted.attainment.get(k)) is not None and (m := r.measured.attainment.get(k)) is not None
    ]
    good_err = [
        abs(r.predicted.goodput_per_worker - r.measured.goodput_per_worker) / r.measured.goodput_per_worker
        for r in done
        if r.measured and r.measured.goodput_per_worker > 0
    ]
    at_pace = [
        abs(r.pace_adjusted.goodput_per_worker - r.measured.goodput_per_worker) / r.measured.goodput_per_worker
        for r in done
        if r.measured and r.pace_adjusted and r.measured.goodput_per_worker > 0
    ]
    return {
        "winner": winner,
        "best_measured": best.candidate.label,
        "regret": regret,
        "attainment_error_max_pts": max(att_err) * 100 if att_err else None,
        "goodput_error_max": max(good_err) if good_err else None,
        "goodput_error_max_at_pace": max(at_pace) if len(at_pace) == len(done) and at_pace else None,
    }


def format_verification(rows: list[VerifyRow], summary: dict[str, Any]) -> str:
    head = ["candidate", "plan #", "attain ttft/tpot/stall pred", "measured", "goodput/worker pred", "measured", "err"]
    head += ["pred at pace", "err"]
    out = [head]
    for r in rows:
        p, m = r.predicted, r.measured
        err = "-"
        if m is not None and m.goodput_per_worker > 0:
            err = f"{(p.goodput_per_worker - m.goodput_per_worker) / m.goodput_per_worker:+.0%}"
        out.append([
            r.candidate.label, str(r.rank) if r.rank else "-", _att(p), _att(m) if m else (r.error or "failed"),
            f"{p.goodput_per_worker:.3f}/s", f"{m.goodput_per_worker:.3f}/s" if m else "-", err,
            *_at_pace(r),
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in out) for i in range(len(head))]
    just = lambda i, c, w: c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
    lines = ["  ".join(just(i, c, w) for i, (c, w) in enumerate(zip(row, widths))) for row in out]
    lines.insert(1, "  ".join("-" * w for w in widths))
    regret = summary.get("regret")
    tail = f"winner {summary['winner']}, best measured {summary['best_measured']}: regret " + (
        f"{regret:.1%}" if regret is not None else "- (the winner was not measured)"
    )
    return "verified on this machine (measured) beside the plan (predicted)\n" + "\n".join(lines) + "\n" + tail


def _at_pace(r: VerifyRow) -> list[str]:
    """The goodput predicted at the pace measured before this server, and its error."""
    a, m = r.pace_adjusted, r.measured
    if a is None:
        return ["-", "-"]
    err = (
        f"{(a.goodput_per_worker - m.goodput_per_worker) / m.goodput_per_worker:+.0%}"
        if m and m.goodput_per_worker > 0
        else "-"
    )
    return [f"{a.goodput_per_worker:.3f}/s", err]


def _att(j: Judged) -> str:
    return "/".join("-" if (v := j.attainment.get(k)) is None else f"{v:.0%}" for k in ("ttft", "tpot", "stall"))
