"""Decode-only stretches: a simulated worker's decode steps between two changes to its batch, run as
one event (costmodel/sim/workers.py `Worker._stretch`). Here is what a stretch holds and how it hands
its steps out (`settle`): the tokens of the steps that have ended, a step-log record for the steps
begun. A worker's step log lives here too, since a stretch writes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.sim.model import Request

STRETCH_STEPS = 1024  # the most decode-only steps one event carries (endless streams decode forever)


@dataclass
class StepRecord:
    start: float
    end: float
    prefill_tokens: int
    decode_tokens: int
    steps: int = 1  # more: a run of decode-only steps (a stretch's), its decode tokens summed


@dataclass
class Stretch:
    """A worker's decode-only steps scheduled as one event: the batch, when the first began, each
    one's end; how many have handed out their tokens, and past which the log has them. Settling
    logs the steps before the latest as one record and the latest as its own (readers of the
    step in progress take `log[-1]`)."""

    batch: list[Request]
    start: float
    ends: list[float]
    ended: int = 0
    logged: int = 0

    def settle(self, log: list[StepRecord], upto: int) -> None:
        """Steps before `upto` ended (their tokens out); `upto` itself, if any, begun (logged)."""
        ends, n = self.ends, len(self.batch)
        last = min(upto, len(ends) - 1)
        if last > self.logged:  # the steps before the latest as one record; the latest as its own
            first = ends[self.logged - 1] if self.logged else self.start
            log.append(StepRecord(first, ends[last - 1], 0, n * (last - self.logged), last - self.logged))
        if last >= self.logged:
            log.append(StepRecord(ends[last - 1] if last else self.start, ends[last], 0, n))
            self.logged = last + 1
        if upto > self.ended:
            out = ends[self.ended : upto]
            for r in self.batch:
                r.token_times.extend(out)
            self.ended = upto


def in_progress(ends: list[float], now: float) -> int:
    """The step in progress at `now`: the first not yet ended (one ending at `now` exactly has
    not: its end event comes after the one being handled)."""
    return next(i for i, t in enumerate(ends) if t >= now)
