"""What `pdserve plan` prints: the ranked table, and why the winner wins in the article's terms
(the prefill tax in decode steps, the stall it leaves against colocated whole, how far the fit's
error moves it, whether the runner-up is a toss-up)."""

from __future__ import annotations

import math

from costmodel.plan.score import Scored, toss_up
from costmodel.sim import compare_predict as cp
from costmodel.workloads import RequestSpec

# without a fit error (a datasheet model): two candidates closer than this on goodput per worker
# are not told apart
TOSS_UP = 0.02


def explain(
    ranked: list[Scored],
    setup: cp.PredictionSetup,
    specs: list[RequestSpec],
    err: float | None,
    max_loss: float = 1.0,
    max_risk: float = 1.0,
) -> str:
    """Why the winner wins, in the article's terms: what a long prompt's prefill costs the
    streams when it runs whole beside them (the prefill tax, in decode steps), and the stall each
    candidate leaves; and which richer candidate the risk ranking passed over, for which limit."""
    w = ranked[0]
    meeting = sum(s.meets for s in ranked)
    parts = [
        f"{w.candidate.label} has the most goodput per worker ({w.goodput_per_worker:.2f} requests/s)"
        + (f" of the {meeting} candidates that meet every SLO" if meeting else "; no candidate meets every SLO")
        + (
            ", once the chance of a miss is weighed"
            if any(s.meets and s.goodput_per_worker > w.goodput_per_worker for s in ranked)
            else ""
        )
    ]
    longest = max(s.prompt_len for s in specs)
    prefill_s = setup.steps.step([], [(0, longest)])
    # colocated whole on the winner's workers: the deployment the article's tax is paid in
    colo = next(
        (s for s in ranked if s.candidate.mode == "colocated" and s.candidate.workers == w.candidate.workers), None
    )
    tpot = colo.metrics.tpot_ms.p50 if colo is not None else None
    if tpot and not math.isnan(tpot):
        tax = prefill_s * 1e3 / tpot
        parts.append(
            f"a {longest}-token prompt's prefill takes {prefill_s * 1e3:.0f} ms, {tax:.0f} decode steps of every "
            f"stream when it runs whole beside them (the prefill tax)"
        )
    stall = w.metrics.stall_ms.p90
    if colo is not None and colo is not w and colo.metrics.stall_ms.p90 is not None and stall is not None:
        parts.append(f"its stall p90 is {stall:.0f} ms against {colo.metrics.stall_ms.p90:.0f} ms colocated whole")
    if w.interval:
        lo, hi = sorted(x or 0.0 for x in w.interval["goodput_per_worker"])
        off = w.price_error or err or 0.0
        parts.append(f"goodput per worker {lo:.2f}-{hi:.2f}/s with every step priced {off:.0%} lower or higher")
        if w.risk and w.risk.miss_chance >= 0.01:
            parts.append(
                f"a {w.risk.miss_chance:.0%} chance a p90 misses its SLO at those prices "
                f"(expected goodput {w.risk.expected_goodput:.2f}/s)"
            )
    richer = [s for s in ranked if s.meets and s.risk and s.goodput_per_worker > w.goodput_per_worker]
    if richer and w.risk:
        e = richer[0]
        assert e.risk is not None  # for mypy: filtered above
        head = f"{e.candidate.label} predicts more goodput ({e.goodput_per_worker:.2f}/s) but has a "
        loss = e.risk.loss(e.goodput_per_worker)
        chance = f"{e.risk.miss_chance:.0%} chance of missing an SLO at the fit's error"
        if e.risk.expected_goodput > w.risk.expected_goodput and loss > max_loss:
            why = f"{chance}, expected to cost it {loss:.0%} of its goodput: above --max-loss {max_loss:g}"
        elif e.risk.expected_goodput > w.risk.expected_goodput:
            why = f"{chance}, above --max-risk {max_risk:g}"
        else:
            why = (
                f"{e.risk.miss_chance:.0%} chance of missing an SLO at the fit's error and expects "
                f"{e.risk.expected_goodput:.2f}/s against {w.risk.expected_goodput:.2f}"
            )
        parts.append(f"{head}{why}: ranked after")
    if len(ranked) > 1:
        r = ranked[1]
        gap = (w.goodput_per_worker - r.goodput_per_worker) / w.goodput_per_worker if w.goodput_per_worker else 0.0
        close = toss_up(w, r) if w.interval and r.interval else gap < TOSS_UP
        if close:
            within = f"its range reaches {w.candidate.label}'s" if w.interval else f"within {TOSS_UP:.0%} on goodput"
            parts.append(f"next: {r.candidate.label}, {within}: a toss-up on these figures")
        else:
            parts.append(f"next: {r.candidate.label}, {gap:.0%} less goodput per worker")
    return "; ".join(parts) + "."


def format_table(ranked: list[Scored]) -> str:
    head = [
        "#",
        "candidate",
        "workers",
        "TTFT p90",
        "TPOT p90",
        "stall p90",
        "attain ttft/tpot/stall",
        "SLOs",
        "miss risk",
    ]
    rows = [[*head, "goodput/worker"]]
    for i, s in enumerate(ranked, 1):
        m, a = s.metrics, s.attainment
        rows.append([
            str(i), s.candidate.label, str(s.candidate.workers), _ms(m.ttft_ms.p90), _ms(m.tpot_ms.p90),
            _ms(m.stall_ms.p90), "/".join(_pct(a[k]) for k in ("ttft", "tpot", "stall")),
            "met" if s.meets else "missed", _pct(s.risk.miss_chance) if s.risk else "-",
            f"{s.goodput_per_worker:.2f}/s",
        ])  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i != 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return (
        "predicted (simulated), not measured; miss risk: the chance a p90 misses its SLO with steps priced at the "
        "fit's error (top candidates, ranked by the goodput it leaves)\n" + "\n".join(lines)
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"
