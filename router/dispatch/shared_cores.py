"""Which steps ran while the other pool was busy, and how much slower they ran for it.

On a host whose prefill and decode workers share the CPU cores (the 2-core dev machine), a decode
step that runs beside a prefill step of the other process is slower than the same step alone, and
so is that prefill. The calibration (`pdserve bench chunks`) times steps alone. This sorts the
steps the workers report (each with its end time) into those that ran alone and those that ran
beside the other pool's steps:

- decode pool, alone (overlap < 10% of the step): refine the pool's step-cost fit;
- decode pool, beside (overlap >= 50%): the ratio measured / fit goes into the pool's sharing
  factor, the running mean of the last `window` such steps (1.0 until one is seen). The
  dispatcher multiplies a decode-worker step it predicts by it while the prefill worker is
  predicted busy, and prices a remote prefill's stall on the streams from it.
- prefill pool: every step refines its fit. Its steps nearly always run beside decoding streams
  (a prefill worker serves requests that are going to decode), so the fit learns the rate under
  that sharing directly; few of its steps run alone, too few to fit shape and factor apart.

A decode step is sorted once the prefill pool's activity over it is known: that worker's log has
passed its end, or it was idle at the last look. (On the 2-core VM a decode step beside a
2048-token prefill measured an order of magnitude slower than alone: the prefill's threads take
both cores.)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from contracts.worker import WorkerStats
from costmodel.fit.step_fit import OnlineStepFit, StepShape

ALONE, BESIDE = 0.1, 0.5  # overlap fractions: below is alone, at or above is beside
KEPT = 4096  # busy intervals kept per pool


@dataclass
class _Step:
    start: float
    end: float
    shape: StepShape
    seconds: float


@dataclass
class _Pool:
    busy: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=KEPT))
    pending: list[_Step] = field(default_factory=list)
    known_until: float = 0.0  # this pool's activity is known up to here
    factor: float = 1.0
    beside: int = 0  # steps folded into the factor
    alone: int = 0


class SharedCores:
    def __init__(self, fits: dict[str, OnlineStepFit], window: int = 50):
        self.fits = fits
        self.window = window
        self.pools = {"decode": _Pool(), "prefill": _Pool()}
        self._seen: dict[str, int] = {}  # worker -> last step number read

    def factor(self, role: str) -> float:
        return self.pools[role].factor

    def observe(self, stats: list[WorkerStats], now: float) -> None:
        for s in stats:
            role = "prefill" if s.role == "prefill" else "decode"
            pool, last = self.pools[role], self._seen.get(s.name, 0)
            for n, ptok, pairs, dseqs, secs, end, _threads, dpairs, items, reads in s.recent_steps:
                if n > last:
                    shape = StepShape.reported(ptok, pairs, dseqs, dpairs, items, reads)
                    step = _Step(end - secs, end, shape, secs)
                    pool.pending.append(step)
                    pool.busy.append((step.start, step.end))
                    pool.known_until = max(pool.known_until, end)
            if s.recent_steps:
                self._seen[s.name] = max(last, s.recent_steps[-1][0])
            if s.queue_depth == 0 and s.running == 0:  # idle at this look: nothing runs until now
                pool.known_until = max(pool.known_until, now)
        for role, other in (("decode", "prefill"), ("prefill", "decode")):
            self._sort(role, self.pools[role], self.pools[other])

    def _sort(self, role: str, pool: _Pool, other: _Pool) -> None:
        fit, changed, keep = self.fits[role], False, []
        for st in pool.pending:
            if role == "prefill":
                fit.observe(st.shape, st.seconds)
                pool.alone += 1  # counted as steps read: see the module docstring
                changed = True
                continue
            if st.end > other.known_until:
                keep.append(st)
                continue
            frac = _overlap(st.start, st.end, other.busy) / max(st.seconds, 1e-9)
            if frac < ALONE:
                fit.observe(st.shape, st.seconds)
                pool.alone += 1
                changed = True
            elif frac >= BESIDE:
                predicted = fit.current.seconds(st.shape)
                if predicted > 0:
                    pool.beside += 1
                    w = 1.0 / min(pool.beside, self.window)
                    pool.factor = (1 - w) * pool.factor + w * (st.seconds / predicted)
        pool.pending = keep
        if changed:
            fit.refit()

    def to_dict(self) -> dict:
        d = self.pools["decode"]
        return {
            "decode": {"factor": round(d.factor, 4), "steps_beside": d.beside, "steps_alone": d.alone},
            "prefill": {"steps": self.pools["prefill"].alone},
        }


def _overlap(a: float, b: float, intervals: deque[tuple[float, float]]) -> float:
    total = 0.0
    for s, e in reversed(intervals):  # newest first, stop well before this step (one pool's
        if e <= a - 5.0:  # workers interleave in the deque within a poll, not across seconds)
            break
        total += max(0.0, min(b, e) - max(a, s))
    return total
