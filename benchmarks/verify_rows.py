"""What `pdserve plan --verify` records of each candidate and prints (benchmarks/plan_verify.py
runs them): a row of predicted beside measured (the workers' steps against the plan's prices:
benchmarks/verify_steps.py), the regret, the worst errors, how many landed inside the plan's own
interval, and the table. With `--repeats R` each candidate is measured R times
in interleaved rounds and its row combines them (`combine`): the mean, and the spread between rounds,
which is how far this machine's own measurement moves (the floor under any prediction's error)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from benchmarks.client.logged_step import LoggedStep, steps_table
from benchmarks.verify_steps import StepPace
from costmodel.plan.candidates import Candidate
from costmodel.plan.score import Judged
from costmodel.serve_metrics import RequestRecord


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
    # the prediction again with its steps priced at this server's pace: "serving", its steps against
    # the plan's prices before the timed pass (plan_calibration.py `serving_pace`: prompt steps at
    # `pace_ratio`, decode rows at `pace_decode_ratio`), or "gemm", the GEMM probe's before it started
    # against the calibration's (`pace_ratio`, every step); None where neither is known
    pace_adjusted: Judged | None = None
    pace_ratio: float | None = None
    pace_basis: str | None = None
    pace_matched_steps: int | None = None  # "serving": the steps read
    pace_decode_ratio: float | None = None
    # not a prediction: the timed pass's own steps against the plan's prices (verify_steps.step_pace),
    # and the plan's prediction re-priced at them after the fact: what is left of its error is the
    # schedule's (queueing, batching), not the step prices'
    run_pace: StepPace | None = None
    run_paced: Judged | None = None
    rounds: list[VerifyRow] = field(default_factory=list)  # each measurement, where there were several
    # request by request, simulated beside measured (`per_request`): where a p90's error comes from
    requests: list[dict[str, Any]] | None = None
    # the workers' steps in the timed pass as they logged them: a step price or a schedule that was
    # off can be read step by step afterwards, beside the simulator's (a row of `STEP_COLUMNS` each)
    steps: list[LoggedStep] = field(default_factory=list)
    pace_steps: list[LoggedStep] = field(default_factory=list)  # the serving pace's, before the timed pass
    # the plan's chance that this candidate misses an SLO at its fit's error (costmodel/plan/risk.py;
    # None: the plan did not weigh it): how near an SLO's edge the prediction was
    miss_risk: float | None = None
    # the plan's goodput per worker with every step priced its fit's error lower and higher (low, high)
    goodput_interval: tuple[float, float] | None = None

    @property
    def goodput_range(self) -> tuple[float, float] | None:
        """The lowest and highest goodput per worker measured over the rounds (None: under two)."""
        got = [r.measured.goodput_per_worker for r in self.rounds if r.measured is not None]
        return (min(got), max(got)) if len(got) >= 2 else None

    def to_dict(self) -> dict[str, Any]:
        rng = self.goodput_range
        extra: dict[str, Any] = {}
        if self.rounds:
            extra = {"goodput_measured_range": list(rng) if rng else None, "rounds": [r.to_dict() for r in self.rounds]}
        return {
            "label": self.candidate.label,
            "serve_args": self.candidate.serve_args(),
            "plan_rank": self.rank,
            "plan_miss_risk": self.miss_risk,
            "plan_goodput_interval": list(self.goodput_interval) if self.goodput_interval else None,
            "predicted": self.predicted.to_dict(),
            "measured": self.measured.to_dict() if self.measured else None,
            "measured_metrics": self.metrics,
            "error": self.error,
            "startup_s": self.startup_s,
            "load_average_at_start": self.load_average,
            "machine_pace_at_start": self.pace,
            "step_prices": self.step_prices,
            "pace_ratio": self.pace_ratio,
            "pace_basis": self.pace_basis,
            "pace_matched_steps": self.pace_matched_steps,
            "pace_decode_ratio": self.pace_decode_ratio,
            "run_pace": self.run_pace.to_dict() if self.run_pace else None,
            "predicted_at_run_pace": self.run_paced.to_dict() if self.run_paced else None,
            "predicted_at_this_pace": self.pace_adjusted.to_dict() if self.pace_adjusted else None,
            "requests": self.requests,
            "steps": steps_table(self.steps) if self.steps else None,
            "pace_steps": steps_table(self.pace_steps) if self.pace_steps else None,
            **extra,
        }


def per_request(simulated: list[RequestRecord], measured: list[RequestRecord]) -> list[dict[str, Any]]:
    """Each request's arrival, prompt, TTFT and TPOT as the simulator had them beside the
    client's (ms; None where a side has none), matched by request id; plus the worker's own
    queue and prefill time where the server's timeline gave them."""
    sim = {r.request_id: r for r in simulated if r.ok}
    ms = lambda s: None if s is None else round(s * 1e3, 1)  # noqa: E731
    out = []
    for m in measured:
        if not m.ok:
            continue
        p = sim.get(m.request_id)
        out.append({
            "id": m.request_id, "arrival_s": round(m.scheduled_s, 3), "prompt": m.prompt_len,
            "ttft_ms": [ms(p.ttft_s) if p else None, ms(m.ttft_s)],
            "tpot_ms": [ms(p.tpot_s) if p else None, ms(m.tpot_s)],
            "worker_queue_ms": m.worker_queue_ms, "worker_prefill_ms": m.worker_prefill_ms,
        })  # fmt: skip
    return out


def combine(rounds: list[VerifyRow]) -> VerifyRow:
    """One candidate's row from its rounds (`--repeats`): the mean of each measured attainment and of
    the goodput, SLOs met only where every round met them, the pace-adjusted prediction averaged
    likewise; the rounds themselves kept. A round that failed counts against nothing but is kept."""
    first = rounds[0]
    if len(rounds) == 1:
        return first
    ok = [r for r in rounds if r.measured is not None]
    errors = [r.error for r in rounds if r.error]
    return VerifyRow(
        first.candidate, first.rank, first.predicted, _mean_judged([r.measured for r in ok if r.measured]),
        _mean_metrics([r.metrics for r in ok]), error="; ".join(errors) if not ok and errors else None,
        startup_s=first.startup_s, load_average=first.load_average, pace=first.pace,
        step_prices=ok[0].step_prices if ok else None,  # the first round's; every round's in `rounds`
        pace_adjusted=_mean_judged([r.pace_adjusted for r in ok if r.pace_adjusted]) if ok else None,
        pace_ratio=_mean([r.pace_ratio for r in ok]), pace_basis=first.pace_basis,
        pace_decode_ratio=_mean([r.pace_decode_ratio for r in ok]),
        run_pace=ok[0].run_pace if ok else None, run_paced=_mean_judged([r.run_paced for r in ok if r.run_paced]),
        rounds=rounds, miss_risk=first.miss_risk, goodput_interval=first.goodput_interval,
    )  # fmt: skip


def _mean(xs: list[float | None]) -> float | None:
    known = [x for x in xs if x]
    return statistics.fmean(known) if known else None


def _mean_metrics(ms: list[dict[str, Any]]) -> dict[str, Any]:
    """Each measured figure's mean over the rounds (None where a round lacks it), like the row's."""
    return {
        k: statistics.fmean(vals) if len(vals := [m[k] for m in ms if m.get(k) is not None]) == len(ms) else None
        for k in (ms[0] if ms else {})
    }


def _mean_judged(js: list[Judged]) -> Judged | None:
    if not js:
        return None
    att: dict[str, float | None] = {}
    for k in js[0].attainment:
        vals = [v for j in js if (v := j.attainment.get(k)) is not None]
        att[k] = statistics.fmean(vals) if vals else None
    return Judged(att, all(j.meets for j in js), statistics.fmean(j.goodput_per_worker for j in js))


def summarize(rows: list[VerifyRow], winner: str, stall_slo_ms: float | None = None) -> dict[str, Any]:
    """Regret and the worst prediction errors over the rows measured; with `stall_slo_ms`, the
    regret again with a deployment whose measured stall p90 misses it worth nothing."""
    done = [r for r in rows if r.measured is not None]
    if not done:
        return {"regret": None, "best_measured": None, "winner": winner}
    best = max(done, key=lambda r: r.measured.goodput_per_worker if r.measured else 0.0)
    chosen = next((r for r in done if r.candidate.label == winner), None)
    best_g = best.measured.goodput_per_worker if best.measured else 0.0
    regret = None
    if chosen is not None and chosen.measured is not None:
        regret = (best_g - chosen.measured.goodput_per_worker) / best_g if best_g > 0 else 0.0
    # the same with a deployment whose measured stall p90 misses its SLO worth nothing, as the
    # plan's risk values it: goodput counts requests within TTFT and TPOT, not the stall a document
    # leaves, so a winner that breaks its stall SLO can read 0% regret by goodput alone
    regret_stall = None
    if stall_slo_ms is not None and chosen is not None and chosen.measured is not None:
        worth = {r.candidate.label: _worth(r, stall_slo_ms) for r in done}
        top = max(worth.values())
        regret_stall = (top - worth[winner]) / top if top > 0 else 0.0
    att_err, good_err = _errors(done)
    away = [r for r in done if r.miss_risk is not None and not EDGE[0] <= r.miss_risk <= EDGE[1]]
    away_att, away_good = _errors(away)
    at_pace = [
        abs(r.pace_adjusted.goodput_per_worker - r.measured.goodput_per_worker) / r.measured.goodput_per_worker
        for r in done
        if r.measured and r.pace_adjusted and r.measured.goodput_per_worker > 0
    ]
    at_run = [
        abs(r.run_paced.goodput_per_worker - r.measured.goodput_per_worker) / r.measured.goodput_per_worker
        for r in done
        if r.measured and r.run_paced and r.measured.goodput_per_worker > 0
    ]
    ranges = [g for r in done if (g := r.goodput_range) is not None and g[1] > 0]
    spreads = [(hi - lo) / ((hi + lo) / 2) for lo, hi in ranges]
    return {
        "winner": winner,
        "best_measured": best.candidate.label,
        "regret": regret,
        "regret_stall_worth_nothing": regret_stall,
        "regret_per_round": _regret_per_round(rows, winner),
        "goodput_spread_max": max(spreads) if spreads else None,
        "attainment_error_max_pts": max(att_err) * 100 if att_err else None,
        "goodput_error_max": max(good_err) if good_err else None,
        "goodput_error_max_at_pace": max(at_pace) if len(at_pace) == len(done) and at_pace else None,
        "goodput_error_max_at_run_pace": max(at_run) if len(at_run) == len(done) and at_run else None,
        "goodput_inside_interval": _inside(done),
        "away_from_edge": {
            "rows": len(away),
            "on_edge_rows": sum(1 for r in done if r.miss_risk is not None and EDGE[0] <= r.miss_risk <= EDGE[1]),
            "attainment_error_max_pts": max(away_att) * 100 if away_att else None,
            "goodput_error_max": max(away_good) if away_good else None,
        },
    }


# a candidate the plan gave a chance of missing an SLO between these is on the SLO's edge: there a few
# percent on the step prices moves many requests across it, and two measurements of one deployment
# differ as much (docs/plan.md, "Accuracy by the plan's own miss risk": 15 of 20 rows away from an
# edge within 10% of goodput and 19 of 20 within 5 points of attainment, 14 and 13 of 23 on one)
EDGE = (0.2, 0.9)


def _errors(rows: list[VerifyRow]) -> tuple[list[float], list[float]]:
    """Each measured row's attainment errors (per SLO, as shares) and goodput errors (relative)."""
    att = [
        abs(p - m)
        for r in rows
        if r.measured
        for k in ("ttft", "tpot", "stall")
        if (p := r.predicted.attainment.get(k)) is not None and (m := r.measured.attainment.get(k)) is not None
    ]
    good = [
        abs(r.predicted.goodput_per_worker - r.measured.goodput_per_worker) / r.measured.goodput_per_worker
        for r in rows
        if r.measured and r.measured.goodput_per_worker > 0
    ]
    return att, good


def _inside(rows: list[VerifyRow]) -> dict[str, int]:
    """How many measured goodputs fell inside the plan's interval for them (the uncertainty it printed)."""
    each = [
        lo <= r.measured.goodput_per_worker <= hi
        for r in rows
        if r.measured is not None and r.goodput_interval is not None
        for lo, hi in [r.goodput_interval]
    ]
    return {"inside": sum(each), "rows": len(each)}


def _worth(r: VerifyRow, stall_slo_ms: float) -> float:
    """Measured goodput per worker, nothing where the measured stall p90 missed its SLO."""
    stall = r.metrics.get("stall_p90_ms")
    missed = stall is not None and stall > stall_slo_ms
    return 0.0 if missed or r.measured is None else r.measured.goodput_per_worker


def _regret_per_round(rows: list[VerifyRow], winner: str) -> list[float | None] | None:
    """The regret within each round alone (None: one round only)."""
    n = max((len(r.rounds) for r in rows), default=0)
    if n < 2:
        return None
    out: list[float | None] = []
    for i in range(n):
        each = [(r.candidate.label, r.rounds[i].measured) for r in rows if i < len(r.rounds)]
        got = {label: m.goodput_per_worker for label, m in each if m is not None}
        best = max(got.values(), default=0.0)
        out.append((best - got[winner]) / best if winner in got and best > 0 else None)
    return out


def format_verification(rows: list[VerifyRow], summary: dict[str, Any]) -> str:
    head = ["candidate", "plan #", "attain ttft/tpot/stall pred", "measured", "goodput/worker pred", "measured", "err"]
    head += ["pred at pace", "err"]
    repeated = any(r.rounds for r in rows)
    if repeated:
        head.insert(6, "rounds' range")
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
        if repeated:
            g = r.goodput_range
            out[-1].insert(6, f"{g[0]:.3f}-{g[1]:.3f}" if g else "-")
    widths = [max(len(row[i]) for row in out) for i in range(len(head))]
    just = lambda i, c, w: c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
    lines = ["  ".join(just(i, c, w) for i, (c, w) in enumerate(zip(row, widths))) for row in out]
    lines.insert(1, "  ".join("-" * w for w in widths))
    regret = summary.get("regret")
    tail = f"winner {summary['winner']}, best measured {summary['best_measured']}: regret " + (
        f"{regret:.1%}" if regret is not None else "- (the winner was not measured)"
    )
    if (stall := summary.get("regret_stall_worth_nothing")) is not None and stall != regret:
        tail += f"; with a stall SLO missed worth nothing: regret {stall:.1%}"
    if summary.get("regret_per_round"):
        each = ", ".join("-" if x is None else f"{x:.1%}" for x in summary["regret_per_round"])
        tail += f" (each round alone: {each})"
    away = summary.get("away_from_edge") or {}
    if away.get("rows") and away.get("goodput_error_max") is not None:
        att, n = away.get("attainment_error_max_pts"), away["rows"]
        tail += (
            f"; away from an SLO's edge (the plan's miss risk under {EDGE[0]:.0%} or over {EDGE[1]:.0%}), "
            f"{n} candidate{'s' if n != 1 else ''}: goodput within {away['goodput_error_max']:.0%}"
            + (f", attainment within {att:.0f} points" if att is not None else "")
            + f" ({away['on_edge_rows']} on an edge)"
        )
    if (inside := summary.get("goodput_inside_interval") or {}).get("rows"):
        tail += f"; measured goodput inside the plan's interval: {inside['inside']} of {inside['rows']}"
    if ran := [r for r in rows if r.run_paced and r.run_pace]:
        tail += (
            "\nre-priced after the fact at each timed pass's own steps (not a prediction; prompt/decode): "
            + ", ".join(
                f"{r.candidate.label} {r.run_paced.goodput_per_worker:.3f}/s ({_ratios(r.run_pace)})"  # type: ignore[union-attr,arg-type]
                for r in ran
            )
        )
        if (worst := summary.get("goodput_error_max_at_run_pace")) is not None:
            tail += f": goodput within {worst:.0%} of measured"
    if summary.get("goodput_spread_max") is not None:
        spread = summary["goodput_spread_max"]
        tail += f"; measured = mean of the rounds, whose goodput moved by up to {spread:.0%}"
    return "verified on this machine (measured) beside the plan (predicted)\n" + "\n".join(lines) + "\n" + tail


def _ratios(p: StepPace) -> str:
    return "/".join(f"{x:.2f}x" if x else "-" for x in (p.prompt, p.decode))


def _at_pace(r: VerifyRow) -> list[str]:
    """The goodput predicted at this server's pace (its basis and ratio), and its error."""
    a, m = r.pace_adjusted, r.measured
    if a is None:
        return ["-", "-"]
    err = (
        f"{(a.goodput_per_worker - m.goodput_per_worker) / m.goodput_per_worker:+.0%}"
        if m and m.goodput_per_worker > 0
        else "-"
    )
    decode = f"/{r.pace_decode_ratio:.2f}x" if r.pace_decode_ratio else ""
    basis = f" ({r.pace_ratio:.2f}x{decode} {r.pace_basis})" if r.pace_ratio and r.pace_basis else ""
    return [f"{a.goodput_per_worker:.3f}/s{basis}", err]


def _att(j: Judged) -> str:
    return "/".join("-" if (v := j.attainment.get(k)) is None else f"{v:.0%}" for k in ("ttft", "tpot", "stall"))
