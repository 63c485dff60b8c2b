"""`--mode auto`: per request, prefill locally (chunked, on the chosen decode worker) or remotely
(prefill pool, then KV over the link), whichever the calibrated cost model says is better under
the SLO pair.

Each worker's prefill queue is modelled explicitly (`WorkerQueue`): the prompts the router sent it
that have no first token yet, and the step boundary it last saw (a realized first token). A
prediction replays that worker's scheduler step by step, as `engine/llm_engine.py` schedules:
FIFO, within a prefill budget per step (the chunk size on a decode worker, whole prompts up to
`max_prefill_tokens` on a prefill worker), each step priced by the step-cost fit f (calibration,
refined online from the steps the workers report) with the decode batch it runs beside (local
prompts that finish join it). For a prompt of P tokens after its cached prefix on that worker
(from the router's prefix index), with S streams decoding on decode worker d:

  Local   TTFT  = end of the step that finishes its last chunk - now   (the queue ahead included)
          stall = sum over its chunks of what the chunk adds to a step    (what each stream loses)
          ITL   = the longest step its chunks are in                      (the longest gap a stream sees)
  Remote  TTFT  = the same replay on the prefill worker (whole prompts, batched as they wait)
          stall = its prefill time x (1 - 1/k): on shared cores the streams' steps run k times
                  slower beside it (k measured, router/shared_cores.py); 0 on separate devices
          then  + KV bytes / measured link + one decode step (admission): the second token

A request's TTFT also holds the Ray hops and the event pump: the hop to the worker (a burst's
prompts reach the worker's queue that much later, together) and the hop back are learned per
placement from the outcomes, from the worker's own stamps (its queue + prefill time and when its
first token or prefill ended), exponentially weighted; queueing, which the replay models, cannot
leak into them.

Under the SLO pair (the request's TTFT, the streams' mean inter-token latency, i.e. TPOT, which is
what goodput counts): local is admissible if its TTFT meets --slo-ttft-ms and every stream in
flight still meets --slo-itl-ms on average with the stall added (a stream whose length is unknown:
its longest gap must); remote if its TTFT meets --slo-ttft-ms. A TTFT "meets" the SLO when it does
with the dispatcher's own running mean |relative TTFT error| for that placement added: a request
predicted just under the SLO is a coin toss. If both are admissible the cheaper in user-seconds
wins (local: TTFT + S * stall; remote: TTFT + transfer + admission + S * stall); if one is, it; if neither, the
one with the earlier first token (a late request still frees its worker sooner). Each decision is
stamped into the request's timeline with both predictions, and the outcome (realized TTFT, and for
local the longest gap the other streams saw) when it is known.

On a CPU the prefill and decode processes share the cores: a decode-worker step run while the
prefill worker is predicted busy costs the measured sharing factor times the fit's price; the
prefill fit learns its rate beside decoding directly (router/shared_cores.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from contracts.worker import WorkerStats
from costmodel import cost_model as cm
from costmodel.step_fit import OnlineStepFit, StepCostFit, StepShape
from router.shared_cores import SharedCores
from router.timeline import Timeline

log = logging.getLogger("pdserve.router.dispatch")

DEFAULT_CHUNK = 128  # local prefill chunk when the decode pool has none configured
MAX_PREFILL_TOKENS = 8192  # a prefill worker's whole-prompt budget per step (engine default)
ERROR_BUCKETS = (0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0)  # |relative error| histogram bounds
WITHIN = 0.15
OVERHEAD_WEIGHT = 0.2  # weight of the newest request in the learned serving overhead and TTFT error
MAX_REPLAY_STEPS = 100_000  # a replay never runs away (each step advances time by f's fixed cost)


@dataclass(frozen=True)
class Stream:
    """A sequence decoding on the decode worker, as the router sees it."""

    context: int  # tokens in its KV (prompt + output so far)
    decoded: int = 0  # output tokens so far
    decode_s: float = 0.0  # seconds since its first token
    max_tokens: int = 0  # its length limit (0: unknown)


@dataclass
class Prediction:
    ttft_s: float
    stall_s: float = 0.0  # per in-flight stream (local only)
    itl_s: float = 0.0  # longest step the in-flight streams see (local) or the admission gap (remote)
    cost_s: float = 0.0
    admissible: bool = True
    queue_s: float = 0.0  # of ttft_s: waiting for the prompts ahead on that worker
    stream_itl_s: float = 0.0  # local: the worst stream's mean inter-token latency with the stall
    decode_step_s: float = 0.0  # the streams' decode step while this prompt prefills
    prefill_s: float = 0.0  # of ttft_s: from its first step to its first token (its own compute)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ttft_ms": round(self.ttft_s * 1e3, 3),
            "queue_ms": round(self.queue_s * 1e3, 3),
            "stall_ms": round(self.stall_s * 1e3, 3),
            "itl_ms": round(self.itl_s * 1e3, 3),
            "stream_itl_ms": round(self.stream_itl_s * 1e3, 3),
            "decode_step_ms": round(self.decode_step_s * 1e3, 3),
            "prefill_ms": round(self.prefill_s * 1e3, 3),
            "cost_ms": round(self.cost_s * 1e3, 3),
            "admissible": self.admissible,
        }


@dataclass
class Decision:
    choice: str  # "local" | "remote"
    local: Prediction
    remote: Prediction
    streams: int  # in flight on the decode worker at the decision
    prompt_tokens: int
    reason: str
    cached: dict[str, int] = field(default_factory=dict)  # cached prefix tokens per side

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision": self.choice,
            "reason": self.reason,
            "streams_in_flight": self.streams,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": dict(self.cached),
            "local": self.local.to_dict(),
            "remote": self.remote.to_dict(),
        }


@dataclass
class _ErrorHist:
    counts: list[int] = field(default_factory=lambda: [0] * (len(ERROR_BUCKETS) + 1))
    total: int = 0
    abs_sum: float = 0.0
    within: int = 0

    def observe(self, rel: float) -> None:
        a = abs(rel)
        i = next((k for k, b in enumerate(ERROR_BUCKETS) if a <= b), len(ERROR_BUCKETS))
        self.counts[i] += 1
        self.total += 1
        self.abs_sum += a
        self.within += a <= WITHIN


@dataclass
class _ReplayCost:
    """What the dispatcher's calls cost the router's event loop (they run on it, synchronously):
    replay iterations and wall time, per entry point."""

    calls: int = 0
    steps: int = 0
    max_steps: int = 0
    seconds: float = 0.0
    max_s: float = 0.0

    def observe(self, steps: int, seconds: float) -> None:
        self.calls += 1
        self.steps += steps
        self.max_steps = max(self.max_steps, steps)
        self.seconds += seconds
        self.max_s = max(self.max_s, seconds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "replay_steps": self.steps,
            "max_replay_steps": self.max_steps,
            "total_ms": round(self.seconds * 1e3, 3),
            "max_ms": round(self.max_s * 1e3, 3),
        }


@dataclass
class Job:
    """A prompt in a prefill worker's queue, as the replay sees it."""

    rid: str
    arrival: float  # when the router sent it (unix seconds)
    start: int  # next prompt position to prefill (its cached prefix skipped)
    end: int  # prompt length


@dataclass
class _Replay:
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
    ) -> _Replay:
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
                return _Replay(t, started, stall, itl, [j for j in jobs if j.start < j.end], steps)
        self.steps_run += MAX_REPLAY_STEPS
        return _Replay(math.inf, started, stall, itl, jobs, MAX_REPLAY_STEPS)

    def add(self, job: Job) -> None:
        if not self.jobs:
            self.anchor = job.arrival
        self.jobs.append(job)

    def realized(
        self, rid: str, t: float, f: StepCostFit, streams: list[int], scale: Slowdown = NO_SLOWDOWN
    ) -> _Replay | None:
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


class AutoDispatcher:
    """Owns the live step-cost fits, each worker's queue model and the dispatch statistics; the
    orchestrator asks it to decide and tells it what happened."""

    def __init__(
        self,
        calibration: cm.Calibration,
        model: cm.ModelSpec,
        kv_dtype: str,
        chunk_size: int | None,
        slo_ttft_s: float,
        slo_itl_s: float,
    ):
        prior = calibration.fitted_steps()
        if prior is None:
            raise ValueError("--mode auto needs a calibration with a step_fit (write one with `pdserve bench chunks`)")
        self.fits = {"decode": OnlineStepFit(prior), "prefill": OnlineStepFit(prior)}
        self.kv_bytes_per_token = cm.kv_bytes_per_token(model, kv_dtype)
        gbps = next(iter(calibration.links_gbps.values()), None) or calibration.mem_bandwidth_gbps or 1.0
        self.link_bps = gbps * cm.GB  # refined from measured transfers
        self.chunk = chunk_size or DEFAULT_CHUNK
        self.slo_ttft_s, self.slo_itl_s = slo_ttft_s, slo_itl_s
        self.cores = SharedCores(self.fits)  # the slowdown of a step run beside the other pool's
        self.counts = {"local": 0, "remote": 0}
        # learned per placement: router -> worker (the prompt reaches the worker's queue this much
        # later) and worker -> router (its first token reaches the router this much later)
        self.hop_in_s = {"local": 0.0, "remote": 0.0}
        self.hop_out_s = {"local": 0.0, "remote": 0.0}
        self.ttft_abs_error = {"local": 0.0, "remote": 0.0}  # learned: mean |relative TTFT error|
        self.errors: dict[str, _ErrorHist] = {"ttft": _ErrorHist(), "stall": _ErrorHist()}
        self.queues: dict[str, WorkerQueue] = {}  # worker name -> its queue model
        # request id -> (placement, worker, whether that worker's queue was empty) until its first token
        self._open: dict[str, tuple[str, str, bool]] = {}
        self.cost = {"decide": _ReplayCost(), "outcome": _ReplayCost()}  # on the router's event loop

    # ---- online refinement -------------------------------------------------------------------
    def observe_stats(self, stats: list[WorkerStats], now: float | None = None) -> None:
        """Fold the steps each worker ran since the last look into its pool's fit (steps run
        alone) or its sharing factor (steps run beside the other pool's)."""
        self.cores.observe(stats, time.time() if now is None else now)

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:  # exponentially weighted link rate
            self.link_bps = 0.8 * self.link_bps + 0.2 * (nbytes / seconds)

    def _queue(self, worker: str, chunk: int | None) -> WorkerQueue:
        q = self.queues.get(worker)
        if q is None:
            q = self.queues[worker] = WorkerQueue(chunk)
        return q

    # ---- the decision ------------------------------------------------------------------------
    def _prefill_busy_until(self, worker: str | None = None) -> float:
        """When the prefill worker's queue model runs dry (0: it is idle); None: any prefill worker."""
        out = 0.0
        for name, q in self.queues.items():
            if q.chunk is None and q.jobs and (worker is None or name == worker):
                f = self.fits["prefill"].current
                out = max(out, q.replay(f, [], q.jobs[-1], q.anchor, self._remote_scale(True)).finish)
        return out

    def _local_scale(self, prefill_busy_until: float) -> Slowdown:
        return Slowdown(self.cores.factor("decode"), prefill_busy_until)

    def _remote_scale(self, decode_busy: bool) -> Slowdown:
        """The prefill fit is learned from steps that ran beside decoding (shared_cores.py)."""
        return NO_SLOWDOWN

    def predict_local(
        self,
        prompt: int,
        cached: int,
        streams: list[Stream],
        now: float = 0.0,
        worker: str = "decode",
        rid: str = "",
        prefill_worker: str = "prefill",
    ) -> Prediction:
        f: StepCostFit = self.fits["decode"].current
        ctxs = [s.context for s in streams]
        q = self._queue(worker, self.chunk)
        scale = self._local_scale(self._prefill_busy_until(prefill_worker))
        at = now + self.hop_in_s["local"]
        r = q.replay(f, ctxs, Job(rid or "?", at, min(cached, prompt - 1), prompt), now, scale)
        ttft = r.finish - now + self.hop_out_s["local"]
        base = f.decode_seconds(ctxs) * scale.at(now) if ctxs else 0.0
        worst = max((_mean_itl(s, base, r.stall_s, r.itl_s) for s in streams), default=0.0)
        lax = 1 + self.ttft_abs_error["local"]
        ok = ttft * lax <= self.slo_ttft_s and worst <= self.slo_itl_s
        queue = max(0.0, r.started - now)
        pred = Prediction(ttft, r.stall_s, r.itl_s, ttft + len(streams) * r.stall_s, ok, queue, worst)
        pred.decode_step_s, pred.prefill_s = base, max(0.0, r.finish - r.started)
        return pred

    def predict_remote(
        self,
        prompt: int,
        cached: int,
        streams: list[Stream],
        now: float = 0.0,
        worker: str = "prefill",
        rid: str = "",
        local_worker: str = "decode",
    ) -> Prediction:
        fp = self.fits["prefill"].current
        q = self._queue(worker, None)
        local = self.queues.get(local_worker)
        scale = self._remote_scale(bool(streams) or bool(local and local.jobs))
        at = now + self.hop_in_s["remote"]
        r = q.replay(fp, [], Job(rid or "?", at, min(cached, prompt - 1), prompt), now, scale)
        ttft = r.finish - now + self.hop_out_s["remote"]
        transfer = prompt * self.kv_bytes_per_token / self.link_bps
        ctxs = [s.context for s in streams]
        # the streams' step while this prefill runs beside them (shared cores: k times slower, so
        # each stream loses 1 - 1/k of the prefill's time), and the admission step after it
        k = self.cores.factor("decode")
        admission = self.fits["decode"].current.decode_seconds(ctxs) if ctxs else 0.0
        ok = ttft * (1 + self.ttft_abs_error["remote"]) <= self.slo_ttft_s
        queue = max(0.0, r.started - now)
        compute = max(0.0, r.finish - r.started)
        stall = compute * (1 - 1 / k) if ctxs and k > 1 else 0.0
        cost = ttft + transfer + admission + len(streams) * stall
        pred = Prediction(ttft, stall, transfer + admission, cost, ok, queue)
        pred.decode_step_s, pred.prefill_s = admission * k, compute
        return pred

    def decide(
        self,
        prompt: int,
        cached_local: int,
        cached_remote: int,
        streams: list[Stream],
        now: float | None = None,
        local_worker: str = "decode",
        prefill_worker: str = "prefill",
        request_id: str | None = None,
    ) -> Decision:
        """Predict both placements and pick one; with `request_id` the choice is committed (it
        joins that worker's queue model until `record_outcome`)."""
        t0, steps0 = time.perf_counter(), self._steps_run()
        t = time.time() if now is None else now
        rid = request_id or ""
        loc = self.predict_local(prompt, cached_local, streams, t, local_worker, rid, prefill_worker)
        rem = self.predict_remote(prompt, cached_remote, streams, t, prefill_worker, rid, local_worker)
        if loc.admissible != rem.admissible:
            choice = "local" if loc.admissible else "remote"
            reason = f"only {choice} meets the SLO"
        elif loc.admissible:
            choice = "local" if loc.cost_s <= rem.cost_s else "remote"
            reason = f"both meet the SLO; {choice} is cheaper"
        else:
            choice = "local" if loc.ttft_s <= rem.ttft_s else "remote"
            reason = f"neither meets the SLO; {choice} has the earlier first token"
        self.counts[choice] += 1
        if request_id is not None:
            worker = local_worker if choice == "local" else prefill_worker
            cached = cached_local if choice == "local" else cached_remote
            q = self._queue(worker, self.chunk if choice == "local" else None)
            idle = not q.jobs
            q.add(Job(request_id, t + self.hop_in_s[choice], min(cached, prompt - 1), prompt))
            self._open[request_id] = (choice, worker, idle)
        sides = {"local": cached_local, "remote": cached_remote}
        self._cost("decide", t0, steps0)
        return Decision(choice, loc, rem, len(streams), prompt, reason, sides)

    def _steps_run(self) -> int:
        return sum(q.steps_run for q in self.queues.values())

    def _cost(self, what: str, t0: float, steps0: int) -> None:
        seconds, steps = time.perf_counter() - t0, self._steps_run() - steps0
        self.cost[what].observe(steps, seconds)
        log.debug("%s: %d replay steps, %.3f ms", what, steps, seconds * 1e3)

    def forget(self, request_id: str) -> None:
        """A request that ended before its first token (abort, error) leaves its worker's queue."""
        placed = self._open.pop(request_id, None)
        if placed is not None:
            self.queues[placed[1]].forget(request_id)

    # ---- outcomes ----------------------------------------------------------------------------
    def record_outcome(
        self, timeline: Timeline | Mapping[str, Any], first_token_at: float | None = None, streams: Sequence[int] = ()
    ) -> None:
        """Stamp predicted vs realized into the timeline's dispatch entry and the histograms; the
        worker's queue model moves to the realized step boundary `first_token_at` (unix s)."""
        tl = timeline if isinstance(timeline, Timeline) else Timeline.from_dict(timeline)
        d = tl.dispatch
        if not d or "outcome" in d or tl.first_token_ms is None:
            return
        t0, steps0 = time.perf_counter(), self._steps_run()
        rid = tl.request_id
        placed = self._open.pop(rid, None)
        choice = d["decision"]
        # the worker's step end: prefill end, or token 0
        end_ms = tl.prefill_end_ms if tl.prefill_end_ms is not None else tl.first_token_ms
        if first_token_at is None:
            first_token_at = tl.arrival + end_ms / 1e3
        if placed is not None and first_token_at is not None:
            role = "decode" if choice == "local" else "prefill"
            scale = self._local_scale(self._prefill_busy_until()) if choice == "local" else self._remote_scale(True)
            self.queues[placed[1]].realized(rid, first_token_at, self.fits[role].current, list(streams), scale)
        pred = d[choice]
        out: dict[str, Any] = {"ttft_ms": tl.first_token_ms}
        out["ttft_error"] = _rel(pred["ttft_ms"], tl.first_token_ms)
        if out["ttft_error"] is not None:
            self.errors["ttft"].observe(out["ttft_error"])
            w = OVERHEAD_WEIGHT
            self.ttft_abs_error[choice] = (1 - w) * self.ttft_abs_error[choice] + w * abs(out["ttft_error"])
        if tl.queue_ms is not None and tl.prefill_ms is not None and (placed is None or placed[2]):
            # what the worker's own queue and steps do not explain: the hops, learned for the next
            # prediction of this placement (queueing is the replay's, never these terms'). The
            # worker's first token (remote: its prefill end) is stamped on the worker's clock
            # (the same host's), so its receipt of the prompt is that minus its own time. Learned
            # only from prompts sent to an idle queue: a worker takes a new prompt in between its
            # steps, so one sent mid-step is received at the step's end, a wait the replay has.
            worker_ms = tl.queue_ms + tl.prefill_ms
            w = OVERHEAD_WEIGHT
            for hops, x in ((self.hop_in_s, end_ms - worker_ms), (self.hop_out_s, tl.first_token_ms - end_ms)):
                hops[choice] = (1 - w) * hops[choice] + w * max(0.0, x / 1e3)
            out["worker_ms"] = round(worker_ms, 3)
        gap = tl.local_max_gap_ms
        if choice == "local" and gap is not None and d["streams_in_flight"]:
            out["stall_ms"] = gap
            out["stall_error"] = _rel(pred["itl_ms"], gap)
            if out["stall_error"] is not None:
                self.errors["stall"].observe(out["stall_error"])
        d["outcome"] = out
        self._cost("outcome", t0, steps0)

    def summary(self) -> dict[str, Any]:
        return {
            "decisions": dict(self.counts),
            "fits": {k: v.current.to_dict() for k, v in self.fits.items()},
            "observed_steps": {k: v.observed for k, v in self.fits.items()},
            "link_gbytes_per_s": self.link_bps / cm.GB,
            "hop_in_ms": {k: v * 1e3 for k, v in self.hop_in_s.items()},
            "hop_out_ms": {k: v * 1e3 for k, v in self.hop_out_s.items()},
            "shared_cores": self.cores.to_dict(),
            "ttft_mean_abs_error": dict(self.ttft_abs_error),
            "event_loop_cost": {k: v.to_dict() for k, v in self.cost.items()},
            "errors": {
                k: {
                    "buckets": list(ERROR_BUCKETS),
                    "counts": h.counts,
                    "count": h.total,
                    "abs_sum": h.abs_sum,
                    "within_15pct": h.within,
                }
                for k, h in self.errors.items()
            },
        }


def _mean_itl(s: Stream, step_s: float, stall_s: float, longest_s: float) -> float:
    """A stream's mean inter-token latency over its whole length once `stall_s` is added; when its
    length is not known, the longest gap it will see (`longest_s`)."""
    if s.max_tokens > max(1, s.decoded):
        return (s.decode_s + (s.max_tokens - s.decoded) * step_s + stall_s) / (s.max_tokens - 1)
    return longest_s


def _rel(predicted: float, measured: float) -> float | None:
    if not measured or not math.isfinite(measured):
        return None
    return round((predicted - measured) / measured, 4)
