"""`--mode auto`: per request, prefill locally (chunked, on the chosen decode worker) or remotely
(prefill pool, then KV over the link), whichever the calibrated cost model says is better under
the SLO pair.

Each worker's prefill queue is modelled explicitly and replayed step by step as its scheduler
would run it (`WorkerQueue`, router/dispatch/replay.py). For a prompt of P tokens after its cached
prefix on that worker (from the router's prefix index), with S streams decoding on decode worker d:

  Local   TTFT  = end of the step that finishes its last chunk - now   (the queue ahead included)
          stall = sum over its chunks of what the chunk adds to a step    (what each stream loses)
          ITL   = the longest step its chunks are in                      (the longest gap a stream sees)
  Remote  TTFT  = the same replay on the prefill worker (whole prompts, batched as they wait)
          stall = its prefill time x (1 - 1/k): on shared cores the streams' steps run k times
                  slower beside it (k measured, router/dispatch/shared_cores.py); 0 on separate devices
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
prefill fit learns its rate beside decoding directly (router/dispatch/shared_cores.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from contracts.worker import WorkerStats
from costmodel.article import cost_model as cm
from costmodel.article.layerwise import LinkSpec, layerwise_exposed_s
from costmodel.fit.step_fit import OnlineStepFit, StepCostFit
from router.dispatch.kv_transfer_policy import KVTransferPolicy
from router.dispatch.replay import MAX_PREFILL_TOKENS, MAX_REPLAY_STEPS, NO_SLOWDOWN, Job, Slowdown, WorkerQueue
from router.dispatch.shared_cores import SharedCores
from router.dispatch.stats import ERROR_BUCKETS, WITHIN, ErrorHist, ReplayCost, rel_error
from router.dispatch.types import Decision, Prediction, Stream
from router.observe.timeline import Timeline

# router.dispatch.dispatcher stays the one import path for `--mode auto`: its types, queue model and statistics
# live in the modules beside it, and every name this module ever exported still resolves here.
__all__ = [
    "DEFAULT_CHUNK",
    "ERROR_BUCKETS",
    "MAX_PREFILL_TOKENS",
    "MAX_REPLAY_STEPS",
    "NO_SLOWDOWN",
    "OVERHEAD_WEIGHT",
    "WITHIN",
    "AutoDispatcher",
    "Decision",
    "Job",
    "Prediction",
    "Slowdown",
    "Stream",
    "WorkerQueue",
]

log = logging.getLogger("pdserve.router.dispatch")

DEFAULT_CHUNK = 128  # local prefill chunk when the decode pool has none configured
OVERHEAD_WEIGHT = 0.2  # weight of the newest request in the learned serving overhead and TTFT error


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
        self.kv_policy: KVTransferPolicy | None = None  # the server's --kv-transfer (the orchestrator sets it)
        self.chunk = chunk_size or DEFAULT_CHUNK
        self.slo_ttft_s, self.slo_itl_s = slo_ttft_s, slo_itl_s
        self.cores = SharedCores(self.fits)  # the slowdown of a step run beside the other pool's
        self.counts = {"local": 0, "remote": 0}
        # learned per placement: router -> worker (the prompt reaches the worker's queue this much
        # later) and worker -> router (its first token reaches the router this much later)
        self.hop_in_s = {"local": 0.0, "remote": 0.0}
        self.hop_out_s = {"local": 0.0, "remote": 0.0}
        self.ttft_abs_error = {"local": 0.0, "remote": 0.0}  # learned: mean |relative TTFT error|
        self.errors: dict[str, ErrorHist] = {"ttft": ErrorHist(), "stall": ErrorHist()}
        self.queues: dict[str, WorkerQueue] = {}  # worker name -> its queue model
        # request id -> (placement, worker, whether that worker's queue was empty) until its first token
        self._open: dict[str, tuple[str, str, bool]] = {}
        self.cost = {"decide": ReplayCost(), "outcome": ReplayCost()}  # on the router's event loop

    # ---- online refinement -------------------------------------------------------------------
    def observe_stats(self, stats: list[WorkerStats], now: float | None = None) -> None:
        """Fold the steps each worker ran since the last look into its pool's fit (steps run
        alone) or its sharing factor (steps run beside the other pool's)."""
        self.cores.observe(stats, time.time() if now is None else now)

    def _transfer_s(self, prompt: int, prefill_s: float) -> float:
        """The KV transfer a remote prefill leaves after it: all of it (bulk), or, when the
        server's --kv-transfer streams this prompt, what the last group leaves (costmodel/article/layerwise.py)."""
        kv = prompt * self.kv_bytes_per_token
        policy = self.kv_policy
        if policy is not None and policy.streams(prompt):
            link = LinkSpec(self.link_bps)
            return layerwise_exposed_s(kv, prefill_s, policy.groups, link)
        return kv / self.link_bps

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
        compute = max(0.0, r.finish - r.started)
        transfer = self._transfer_s(prompt, compute)
        ctxs = [s.context for s in streams]
        # the streams' step while this prefill runs beside them (shared cores: k times slower, so
        # each stream loses 1 - 1/k of the prefill's time), and the admission step after it
        k = self.cores.factor("decode")
        admission = self.fits["decode"].current.decode_seconds(ctxs) if ctxs else 0.0
        ok = ttft * (1 + self.ttft_abs_error["remote"]) <= self.slo_ttft_s
        queue = max(0.0, r.started - now)
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
        out["ttft_error"] = rel_error(pred["ttft_ms"], tl.first_token_ms)
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
            out["stall_error"] = rel_error(pred["itl_ms"], gap)
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
            "errors": {k: h.to_dict() for k, h in self.errors.items()},
        }


def _mean_itl(s: Stream, step_s: float, stall_s: float, longest_s: float) -> float:
    """A stream's mean inter-token latency over its whole length once `stall_s` is added; when its
    length is not known, the longest gap it will see (`longest_s`)."""
    if s.max_tokens > max(1, s.decoded):
        return (s.decode_s + (s.max_tokens - s.decoded) * step_s + stall_s) / (s.max_tokens - 1)
    return longest_s
