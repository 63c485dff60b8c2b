"""How likely each top candidate is to miss an SLO when its steps cost more than the fit says,
and the goodput to expect once that chance is weighed.

The fit's own error (`rms_rel_error`) is read as one standard deviation of a price factor k
applied to every step: the plan simulates the top candidates at k = 1 - err and 1 + err
(`score.interval`). Each p90 figure is taken as linear in k between the fit's price and the
interval's worse end, so the SLO is crossed at z = (limit - p90) / (worse - p90) standard
deviations, and the chance of crossing it is 1 - Phi(z).

Goodput counts requests within the TTFT and TPOT SLOs, so past a TTFT or TPOT crossing it is
worth what the interval's worse end measured (many requests just over the line: a cliff where
the distribution is tight); the stall is not in goodput, so past a stall crossing the
deployment is worth nothing to a user who asked for that SLO.

Expected goodput alone gambles: a candidate 14 ms inside its TPOT SLO at the fit's prices, with a
44% chance of a miss, expected 1.27 requests/s per worker against 1.08 for one that holds (1%);
it measured 1.01 (predicted 1.98; the shared-prefix chat at rate 3, 2026-12-05 16:51), its steps
pricier than the fit at batches it had not been calibrated on. A cap on the chance of a miss
alone (`--max-risk 0.2`, the rule of 2026-12-05 17:00) is too cautious where the cliff is soft:
on the article mix it passed over a 34% candidate that keeps three quarters of its goodput past
the SLO, which measured 0.17-0.30 (mean 0.26, eight runs) against 0.19-0.25 for the one it chose
(ahead in seven of the eight; regret 13.5% in the run of that rule). What tells the two apart
is the share of its goodput a candidate expects to lose to its misses, 1 - expected / predicted:
8.5% for the article's chunked 64, 36% for the chat's chunked 256. So candidates expected to lose
more than `max_loss` (`pdserve plan --max-loss`, default 0.2: between the two, and checked on a
machine and workloads it was not set from, docs/plan.md) rank after those that hold, and so do
those whose chance of a miss is above `max_risk` (`--max-risk`, default 1: off; a user whose SLO
is a contract sets it); each group by expected goodput.

Why not a rule of "meets even at the high price" (the one before, 2026-12-05): it put a
candidate whose TPOT p90 would be 251 ms against a 250 ms SLO, losing a quarter of its goodput
there, behind three that held, and the plan gave up 26.6% of the measured goodput (docs/plan.md,
"Risk, not margin; chunk sizes priced by their own fit").
"""

from __future__ import annotations

import math

from costmodel.plan.score import Risk, Scored, Slos

GOODPUT_SLOS = ("ttft", "tpot")  # the SLOs goodput counts request by request


def crossing(mid: float | None, ends: list[float], limit: float | None) -> float:
    """Standard deviations of price until a p90 at `mid` (the fit's price) reaches `limit`, given
    its values `ends` at one deviation either way: inf where it never does; negative where it is
    already past (how far prices must fall to meet it; -inf where they cannot)."""
    if limit is None or mid is None or math.isnan(mid):
        return math.inf
    ends = [e for e in ends if not math.isnan(e)]
    worse, better = max(ends, default=mid), min(ends, default=mid)
    if mid > limit:
        return -(mid - limit) / (mid - better) if better < mid else -math.inf
    if worse <= mid:
        return math.inf
    return (limit - mid) / (worse - mid)


def phi(z: float) -> float:
    """The standard normal's cumulative distribution."""
    if math.isinf(z):
        return 1.0 if z > 0 else 0.0
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def risk_of(s: Scored, slos: Slos) -> Risk | None:
    """`s`'s chance of missing and expected goodput (None: no interval to judge it by)."""
    if not s.interval:
        return None
    m = s.metrics
    mids = {"ttft": m.ttft_ms.p90, "tpot": m.tpot_ms.p90, "stall": m.stall_ms.p90}
    limits = {"ttft": slos.ttft_ms, "tpot": slos.tpot_ms, "stall": slos.stall_ms}
    z = {}
    for name in mids:
        ends = [x for x in s.interval.get(f"{name}_p90_ms", ()) if x is not None]
        z[name] = crossing(mids[name], ends, limits[name])
    held_goodput = phi(min(z[n] for n in GOODPUT_SLOS))  # chance k is below the first TTFT/TPOT crossing
    held_stall = phi(z["stall"])
    g_ends = [x for x in s.interval["goodput_per_worker"] if x is not None]
    g_miss = min(g_ends, default=0.0)
    expected = s.goodput_per_worker * min(held_goodput, held_stall) + g_miss * max(0.0, held_stall - held_goodput)
    return Risk(1.0 - min(held_goodput, held_stall), expected)


def rank_by_risk(
    ranked: list[Scored], slos: Slos, top: int, max_loss: float = 1.0, max_risk: float = 1.0
) -> list[Scored]:
    """`ranked` with its first `top` re-sorted: those meeting every SLO at the fit's prices first;
    among them those expected to lose at most `max_loss` of their goodput to misses and whose
    chance of a miss is at most `max_risk` first; each group by expected goodput per worker (each
    candidate gets its `risk`); the rest as ranked."""
    for s in ranked[:top]:
        s.risk = risk_of(s, slos)
    worth = lambda s: s.risk.expected_goodput if s.risk else s.goodput_per_worker  # noqa: E731

    def risky(s: Scored) -> bool:
        r = s.risk
        return r is not None and (r.miss_chance > max_risk or r.loss(s.goodput_per_worker) > max_loss)

    head = sorted(ranked[:top], key=lambda s: (not s.meets, risky(s), -worth(s)))
    return head + ranked[top:]
