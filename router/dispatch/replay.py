"""The auto dispatcher's model of each worker's prefill queue (router/dispatch/dispatcher.py asks it when a
prompt would get its first token there, and what its chunks would cost the streams beside it).

A `WorkerQueue` holds the prompts the router sent that worker that have no first token yet, and the
step boundary it last saw (a realized first token). A prediction replays that worker's scheduler
step by step, as `engine/core/llm_engine.py` schedules: FIFO, within a prefill budget per step (the
chunk size on a decode worker, whole prompts up to `max_prefill_tokens` on a prefill worker), each
step priced by the step-cost fit f (calibration, refined online from the steps the workers report)
with the decode batch it runs beside (local prompts that finish join it).

It knows nothing of SLOs or placements: it answers "when, and at what cost to the decode steps",
for whichever worker it models; the policy weighs the answers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from costmodel.fit.step_fit import StepCostFit, StepShape

MAX_PREFILL_TOKENS = 8192  # a prefill worker's whole-prompt budget per step (engine default)
MAX_REPLAY_STEPS = 100_000  # a replay never runs away (each step advances time by f's fixed cost)


@dataclass
class Job:
    """A prompt in a prefill worker's queue, as the replay sees it."""

    rid: str
    arrival: float  # when the router sent it (unix seconds)
    start: int  # next prompt position to prefill (its cached prefix skipped)
    end: int  # prompt length


@dataclass
class Replay:
    """One replay's answer for its target prompt."""

    finish: float  # when the target's last chunk ends (inf: never, in MAX_REPLAY_STEPS)
    started: float  # when the target's first chunk began
    stall_s: float  # what its chunks added to the steps they ran in
    itl_s: float  # the longest of those steps
    jobs: list[Job]  # the queue's state right after the target finished
    steps: int = 0  # loop iterations it took (an idle stretch is one): its cost, O(jobs x chunks)


@dataclass(frozen=True)
class Slowdown:
    """A step starting at t costs `factor` times the fit's price while t < `until` (the other
    pool predicted busy beside it), the fit's price after. Piecewise constant, so the replay can
    cross an idle stretch in one jump instead of one decode step at a time."""

    factor: float = 1.0
    until: float = -math.inf

    def at(self, t: float) -> float:
        return self.factor if t < self.until else 1.0

    def constant_until(self, t: float) -> float:
        """The end of the stretch from t over which `at` does not change."""
        return self.until if t < self.until else math.inf


NO_SLOWDOWN = Slowdown()


class WorkerQueue:
    """The dispatcher's model of one worker's prefill queue: the prompts sent to it without a first
    token yet, from the last step boundary it saw (`anchor`). `chunk`: the decode worker's chunk
    size (prompts share it per step and finished ones join the decode batch); None: a prefill
    worker (whole prompts up to MAX_PREFILL_TOKENS a step, the first whatever its length)."""

    def __init__(self, chunk: int | None):
        self.chunk = chunk
        self.jobs: list[Job] = []
        self.anchor = 0.0
        self.steps_run = 0  # replay iterations so far (the dispatcher reports its cost)

    def replay(
        self, f: StepCostFit, streams: list[int], target: Job, now: float, scale: Slowdown = NO_SLOWDOWN
    ) -> Replay:
        """Run the worker's scheduler over its queue plus `target` (if not already in it); a step
        starting at t costs `scale.at(t)` times what f says (the other pool busy beside it).

        Its cost is O(jobs x chunks): every iteration prefills a chunk, or crosses a whole idle
        stretch (no prompt waiting: decode-only steps until the next arrival) in one jump, so a
        queue anchored long ago costs no more than a fresh one."""
        jobs = [Job(j.rid, j.arrival, j.start, j.end) for j in self.jobs]
        if not any(j.rid == target.rid for j in jobs):
            jobs.append(Job(target.rid, target.arrival, target.start, target.end))
        ctxs = list(streams)
        base = f.decode_seconds(ctxs) if ctxs else 0.0
        # from the last boundary seen when prompts are ahead; idle: now, or (decoding) on average
        # half a decode step later, when the step in progress ends
        t = self.anchor if self.jobs else target.arrival + (base / 2 if self.chunk and ctxs else 0.0)
        budget0 = self.chunk or MAX_PREFILL_TOKENS
        started, stall, itl = math.inf, 0.0, 0.0
        for steps in range(1, MAX_REPLAY_STEPS + 1):
            waiting = [j for j in jobs if j.arrival <= t and j.start < j.end]
            work: list[tuple[Job, int]] = []
            budget = budget0
            for j in waiting:
                if budget <= 0:
                    break
                n = min(j.end - j.start, budget) if self.chunk else j.end - j.start
                if not self.chunk and work and n > budget:
                    break
                work.append((j, n))
                budget -= n
            if not work:
                arrives = min(j.arrival for j in jobs if j.start < j.end)
                if self.chunk and ctxs:
                    # decode-only steps run meanwhile: as many as start before the next arrival
                    # (at least the one in progress), the slowdown constant over them
                    step = f.decode_seconds(ctxs) * scale.at(t)
                    edge = min(arrives, scale.constant_until(t))
                    t += max(1, math.ceil((edge - t) / step)) * step if step > 0 else max(0.0, arrives - t)
                else:
                    t = max(t, arrives)
                continue
            decode = ctxs if self.chunk else []
            k = scale.at(t)
            step = f.seconds(StepShape.of(decode, [(j.start, n) for j, n in work])) * k
            for j, n in work:
                if j.rid == target.rid:
                    started = min(started, t)
                    stall += (f.seconds(StepShape.of((), [(j.start, n)])) - f.fixed_s) * k
                    itl = max(itl, step)
            t += step
            for j, n in work:
                j.start += n
                if j.start >= j.end and self.chunk:
                    ctxs.append(j.end + 1)  # a local prompt's first token: it decodes from now on
            if any(j.rid == target.rid and j.start >= j.end for j, _ in work):
                self.steps_run += steps
                return Replay(t, started, stall, itl, [j for j in jobs if j.start < j.end], steps)
        self.steps_run += MAX_REPLAY_STEPS
        return Replay(math.inf, started, stall, itl, jobs, MAX_REPLAY_STEPS)

    def add(self, job: Job) -> None:
        if not self.jobs:
            self.anchor = job.arrival
        self.jobs.append(job)

    def realized(
        self, rid: str, t: float, f: StepCostFit, streams: list[int], scale: Slowdown = NO_SLOWDOWN
    ) -> Replay | None:
        """`rid` got its first token at `t`, a step boundary: what the replay says is left of the
        prompts behind it stays queued, from `t`; it and every prompt ahead of it (FIFO) are done."""
        k = next((i for i, j in enumerate(self.jobs) if j.rid == rid), None)
        if k is None:
            return None
        r = self.replay(f, streams, self.jobs[k], t, scale)
        left = {j.rid: j for j in r.jobs}
        self.jobs = [left.get(j.rid, Job(j.rid, j.arrival, j.end - 1, j.end)) for j in self.jobs[k + 1 :]]
        self.anchor = t
        return r

    def forget(self, rid: str) -> None:
        self.jobs = [j for j in self.jobs if j.rid != rid]
