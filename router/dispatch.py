"""`--mode auto`: per request, prefill locally (chunked, on the chosen decode worker) or remotely
(prefill pool, then KV over the link), whichever the calibrated cost model says is cheaper.

For a prompt of P tokens (after its cached prefix, once prefix caching reports one), with S
streams decoding on decode worker d at contexts c_1..c_S and the step-cost fit f (calibration,
refined online from the steps the workers report):

  Local   chunks of C tokens ride along d's decode steps:
            TTFT  = sum_j f(decode batch + chunk j)            (its local queue ahead included)
            stall = sum_j [f(batch + chunk j) - f(batch)]      (what each of the S streams loses)
            ITL   = max_j f(batch + chunk j)                   (the longest gap a stream sees)
  Remote  TTFT  = prefill queue + f(prompt alone) on the prefill worker
            then  + KV bytes / measured link + one decode step (admission): the second token

Under the SLO pair: local is admissible if TTFT <= --slo-ttft-ms and, with streams in flight,
ITL <= --slo-itl-ms; remote if TTFT <= --slo-ttft-ms. If both are, the cheaper in user-seconds
wins (local: TTFT + S * stall; remote: TTFT + transfer + admission); if one is, it; if neither,
the cheaper. Each decision is stamped into the request's timeline with both predictions, and the
outcome (realized TTFT, and for local the longest gap the other streams saw) when it is known.

A request's TTFT is more than its steps: the Ray calls, the wait for the worker's loop, the event
pump. That serving overhead is learned per placement from the outcomes (exponentially weighted
mean of realized TTFT - predicted compute; recent requests weigh more) and added to both TTFT
predictions. Not modelled beyond it: on a CPU the prefill worker's process sharing the cores with
the decode worker's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from contracts.worker import WorkerStats
from costmodel import cost_model as cm
from costmodel.step_fit import OnlineStepFit, StepCostFit, StepShape

DEFAULT_CHUNK = 128  # local prefill chunk when the decode pool has none configured
ERROR_BUCKETS = (0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0)  # |relative error| histogram bounds
WITHIN = 0.15
OVERHEAD_WEIGHT = 0.2  # weight of the newest request in the learned serving overhead


@dataclass
class Prediction:
    ttft_s: float
    stall_s: float = 0.0  # per in-flight stream (local only)
    itl_s: float = 0.0  # longest step the in-flight streams see (local) or the admission gap (remote)
    cost_s: float = 0.0
    admissible: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "ttft_ms": round(self.ttft_s * 1e3, 3),
            "stall_ms": round(self.stall_s * 1e3, 3),
            "itl_ms": round(self.itl_s * 1e3, 3),
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision": self.choice,
            "reason": self.reason,
            "streams_in_flight": self.streams,
            "prompt_tokens": self.prompt_tokens,
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


class AutoDispatcher:
    """Owns the live step-cost fits and the dispatch statistics; the orchestrator asks it to
    decide and tells it what happened."""

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
        self._seen: dict[str, int] = {}  # worker -> last step number folded into the fit
        self.counts = {"local": 0, "remote": 0}
        self.overhead_s = {"local": 0.0, "remote": 0.0}  # learned: realized TTFT - predicted compute
        self.errors: dict[str, _ErrorHist] = {"ttft": _ErrorHist(), "stall": _ErrorHist()}

    # ---- online refinement -------------------------------------------------------------------
    def observe_stats(self, stats: list[WorkerStats]) -> None:
        """Fold the steps each worker ran since the last look into its pool's fit."""
        for role in ("decode", "prefill"):
            changed = False
            for s in stats:
                if (s.role if s.role == "prefill" else "decode") != role:
                    continue
                last = self._seen.get(s.name, 0)
                for n, ptok, pairs, dseqs, secs in s.recent_steps:
                    if n > last:
                        self.fits[role].observe(StepShape(ptok, float(pairs), dseqs), secs)
                        changed = True
                if s.recent_steps:
                    self._seen[s.name] = max(last, s.recent_steps[-1][0])
            if changed:
                self.fits[role].refit()

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:  # exponentially weighted link rate
            self.link_bps = 0.8 * self.link_bps + 0.2 * (nbytes / seconds)

    # ---- the decision ------------------------------------------------------------------------
    def predict_local(self, prompt: int, cached: int, streams: list[int], queued: list[int]) -> Prediction:
        f: StepCostFit = self.fits["decode"].current
        base = f.decode_seconds(streams) if streams else 0.0
        ttft = stall = itl = 0.0
        # prompts already prefilling locally on this worker run first (FIFO), then this one
        for length, start in [(q, 0) for q in queued] + [(prompt, cached)]:
            for s in range(start, length, self.chunk):
                t = f.seconds(StepShape.of(streams, [(s, min(self.chunk, length - s))]))
                ttft += t
                stall += t - base
                itl = max(itl, t)
        ttft += self.overhead_s["local"]
        ok = ttft <= self.slo_ttft_s and (not streams or itl <= self.slo_itl_s)
        return Prediction(ttft, stall, itl, ttft + len(streams) * stall, ok)

    def predict_remote(self, prompt: int, cached: int, prefill_queue: list[int], streams: list[int]) -> Prediction:
        fp = self.fits["prefill"].current
        wait = sum(fp.prefill_seconds(q) for q in prefill_queue)
        ttft = wait + fp.prefill_seconds(prompt, cached) + self.overhead_s["remote"]
        transfer = prompt * self.kv_bytes_per_token / self.link_bps
        admission = self.fits["decode"].current.decode_seconds(streams) if streams else 0.0
        return Prediction(ttft, 0.0, transfer + admission, ttft + transfer + admission, ttft <= self.slo_ttft_s)

    def decide(
        self, prompt: int, cached: int, streams: list[int], local_queue: list[int], prefill_queue: list[int]
    ) -> Decision:
        loc = self.predict_local(prompt, cached, streams, local_queue)
        rem = self.predict_remote(prompt, cached, prefill_queue, streams)
        if loc.admissible != rem.admissible:
            choice = "local" if loc.admissible else "remote"
            reason = f"only {choice} meets the SLO"
        else:
            choice = "local" if loc.cost_s <= rem.cost_s else "remote"
            reason = ("both meet the SLO" if loc.admissible else "neither meets the SLO") + f"; {choice} is cheaper"
        self.counts[choice] += 1
        return Decision(choice, loc, rem, len(streams), prompt, reason)

    # ---- outcomes ----------------------------------------------------------------------------
    def record_outcome(self, tl: dict[str, Any]) -> None:
        """Stamp predicted vs realized into the timeline's dispatch entry and the histograms."""
        d = tl.get("dispatch")
        if not d or "outcome" in d or "first_token_ms" not in tl:
            return
        pred = d[d["decision"]]
        out: dict[str, Any] = {"ttft_ms": tl["first_token_ms"]}
        out["ttft_error"] = _rel(pred["ttft_ms"], tl["first_token_ms"])
        if out["ttft_error"] is not None:
            self.errors["ttft"].observe(out["ttft_error"])
            # what the steps do not explain, learned for the next prediction of this placement
            choice = d["decision"]
            residual = (tl["first_token_ms"] - pred["ttft_ms"]) / 1e3 + self.overhead_s[choice]
            self.overhead_s[choice] = max(
                0.0, (1 - OVERHEAD_WEIGHT) * self.overhead_s[choice] + OVERHEAD_WEIGHT * residual
            )
        gap = tl.get("local_max_gap_ms")
        if d["decision"] == "local" and gap is not None and d["streams_in_flight"]:
            out["stall_ms"] = gap
            out["stall_error"] = _rel(pred["itl_ms"], gap)
            if out["stall_error"] is not None:
                self.errors["stall"].observe(out["stall_error"])
        d["outcome"] = out

    def summary(self) -> dict[str, Any]:
        return {
            "decisions": dict(self.counts),
            "fits": {k: v.current.to_dict() for k, v in self.fits.items()},
            "observed_steps": {k: v.observed for k, v in self.fits.items()},
            "link_gbytes_per_s": self.link_bps / cm.GB,
            "serving_overhead_ms": {k: v * 1e3 for k, v in self.overhead_s.items()},
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


def _rel(predicted: float, measured: float) -> float | None:
    if not measured or not math.isfinite(measured):
        return None
    return round((predicted - measured) / measured, 4)
