"""Each candidate simulated on one device model and workload, scored against the SLOs, ranked.

Every figure here is *predicted* (the discrete-event simulator on a calibrated or datasheet step
model: costmodel/sim/). A candidate meets an SLO when the p90 of that figure over the workload
is within it: TTFT and TPOT over the requests, the stall over the documents (the longest gap a
document's prefill puts in the streams already decoding). Goodput counts the requests whose own
TTFT and TPOT are within the SLOs, per second and per worker. Ranking: candidates that meet
every SLO given first, then by goodput per worker, then by lower stall p90.

Intervals: a step fit's prices are off by its own error (`rms_rel_error` over the steps it was
fitted on), so the top candidates are simulated again with every term of the fit priced that
much lower and higher (`interval`). Where the winner's goodput range overlaps the next one's, the choice is
a toss-up on these figures. Step jitter under load is not in it yet; a datasheet model has no
fit error to give and gets no interval.

Risk: the top candidates are then ranked by the goodput to expect once the chance that a step
priced at the fit's error pushes a p90 past its SLO is weighed (costmodel/plan/risk.py). A
deployment whose p90 sits within its fit's error of an SLO is a cliff: on the 2-core dev VM one
such candidate (TPOT p90 199 ms predicted against a 200 ms SLO) measured goodput 0.86 against
1.67 predicted (docs/plan.md, "Repeated rounds").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from costmodel.fit.step_fit import StepCostFit
from costmodel.plan.candidates import Candidate
from costmodel.serve_metrics import RequestRecord, ServeMetrics
from costmodel.sim import compare_predict as cp
from costmodel.workloads import RequestSpec
from engine.config import BATCH_WAIT_MAX_S, BATCH_WAIT_S


@dataclass(frozen=True)
class Slos:
    """p90 targets in ms; None: not asked for."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    stall_ms: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_p90_ms": self.ttft_ms, "tpot_p90_ms": self.tpot_ms, "stall_p90_ms": self.stall_ms}


@dataclass(frozen=True)
class Risk:
    """A candidate's chance of missing an SLO at the fit's error, and the goodput to expect
    (costmodel/plan/risk.py)."""

    miss_chance: float  # chance any SLO given is missed with the price factor ~ N(1, err)
    expected_goodput: float  # goodput per worker weighed by those chances

    def loss(self, goodput: float) -> float:
        """The share of `goodput` (the candidate's at the fit's prices) the misses are expected to cost."""
        return max(0.0, 1.0 - self.expected_goodput / goodput) if goodput > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        return {"miss_chance": self.miss_chance, "expected_goodput_per_worker": self.expected_goodput}


@dataclass
class Scored:
    candidate: Candidate
    metrics: ServeMetrics
    attainment: dict[str, float | None]  # per SLO: the share of requests (documents for stall) within it
    meets: bool  # the p90 of every SLO given is within it
    goodput_per_worker: float  # requests/s within the TTFT and TPOT SLOs (all completed if none), per worker
    # figure -> (at step prices lowered, raised by the fit's error); None: not computed
    interval: dict[str, tuple[float | None, float | None]] | None = None
    peak_batch: int = 0  # the most requests decoding at once on one decode-side worker (evenly spread)
    risk: Risk | None = None  # chance of a miss and expected goodput at the fit's error (top candidates)
    price_error: float | None = None  # the relative error its interval and risk price its steps at
    records: list[RequestRecord] = field(default_factory=list, repr=False)  # the simulated requests

    def to_dict(self) -> dict[str, Any]:
        m = self.metrics
        return {
            "label": self.candidate.label,
            "mode": self.candidate.mode,
            "prefill": self.candidate.prefill,
            "decode": self.candidate.decode,
            "chunk_size": self.candidate.chunk,
            "kv_transfer": self.candidate.kv_transfer if self.candidate.mode in ("disagg", "auto") else None,
            "workers": self.candidate.workers,
            "serve_args": self.candidate.serve_args(),
            "predicted": {
                "ttft_p90_ms": m.ttft_ms.p90,
                "tpot_p90_ms": m.tpot_ms.p90,
                "stall_p90_ms": m.stall_ms.p90,
                "output_tokens_per_s": m.output_throughput,
                "attainment": self.attainment,
                "meets_slos": self.meets,
                "goodput_per_worker": self.goodput_per_worker,
                "interval": {k: list(v) for k, v in self.interval.items()} if self.interval else None,
                "risk": self.risk.to_dict() if self.risk else None,
                "price_error": self.price_error,
            },
        }


def score(
    cand: Candidate, setup: cp.PredictionSetup, specs: list[RequestSpec], slos: Slos, max_num_seqs: int
) -> Scored:
    """One candidate through the simulator."""
    sim_mode = cand.mode if cand.mode in ("disagg", "auto") else "colocated"
    # what the calibration measured beyond the steps: decode admission, decode steps beside a
    # prefill on shared cores, the serving hop (0 and 1 where it measured none)
    cfg = cp.sim_config(
        sim_mode, cand.chunk, cand.prefill, cand.decode, max_num_seqs, setup.link, setup.admit_s,
        setup.decode_slowdown, kv_transfer=cand.kv_transfer, prefix_policy=cand.prefix_policy,
        prefill_slowdown=setup.prefill_slowdown, auto_slos_s=(cand.slo_ttft_ms / 1e3, cand.slo_itl_ms / 1e3),
        # a pdserve server's engine loop (the candidates are pdserve's)
        batch_wait_s=BATCH_WAIT_S, batch_wait_max_s=BATCH_WAIT_MAX_S,
    )  # fmt: skip
    pred = cp.predict(cand.label, cfg, setup, specs, slos.ttft_ms, slos.tpot_ms, setup.hop_s)
    j = judge(pred.records, pred.metrics, slos, cand.workers)
    return Scored(
        cand, pred.metrics, j.attainment, j.meets, j.goodput_per_worker, peak_batch=_peak(pred.records, cand),
        records=list(pred.records),
    )  # fmt: skip


def _peak(records: Sequence[RequestRecord], cand: Candidate) -> int:
    """The most requests between their first and last token at once, per decode-side worker."""
    return -(-decoding_batch(records)[0] // max(1, cand.decode))


def decoding_batch(records: Sequence[RequestRecord]) -> tuple[int, float]:
    """(the most requests between their first and last token at once, how many on average while any
    is), over every worker."""
    edges = sorted(
        (t, d) for r in records if r.chunk_times_s for t, d in ((r.chunk_times_s[0], 1), (r.chunk_times_s[-1], -1))
    )
    now = peak = 0
    busy = weighted = 0.0
    for i, (t, d) in enumerate(edges):
        now += d
        peak = max(peak, now)
        if now > 0 and i + 1 < len(edges):  # until the next edge, `now` requests decode
            span = edges[i + 1][0] - t
            busy, weighted = busy + span, weighted + now * span
    return peak, weighted / busy if busy > 0 else 0.0


@dataclass(frozen=True)
class Judged:
    """A run's standing against the SLOs, simulated or measured alike."""

    attainment: dict[str, float | None]  # per SLO: the share of requests (documents for stall) within it
    meets: bool  # the p90 of every SLO given is within it
    goodput_per_worker: float

    def to_dict(self) -> dict[str, Any]:
        return {"attainment": self.attainment, "meets_slos": self.meets, "goodput_per_worker": self.goodput_per_worker}


def judge(records: Sequence[RequestRecord], m: ServeMetrics, slos: Slos, workers: int) -> Judged:
    """Attainment, SLOs met and goodput per worker of one run's records and metrics (the
    simulator's, or a measured run's: `pdserve plan --verify` judges both with this)."""
    done = [r for r in records if r.ok]
    att = {
        "ttft": share_within([r.ttft_s * 1e3 for r in done if r.ttft_s is not None], slos.ttft_ms),
        "tpot": share_within([r.tpot_s * 1e3 for r in done if r.tpot_s is not None], slos.tpot_ms),
        "stall": share_within([d.stall_s * 1e3 for d in m.documents if d.stall_s is not None], slos.stall_ms),
    }
    meets = all(
        lim is None or d.count == 0 or (d.p90 is not None and d.p90 <= lim)
        for d, lim in ((m.ttft_ms, slos.ttft_ms), (m.tpot_ms, slos.tpot_ms), (m.stall_ms, slos.stall_ms))
    )
    good = m.goodput if m.goodput is not None else m.request_throughput
    return Judged(att, meets, good / max(1, workers))


def share_within(values: list[float], limit: float | None) -> float | None:
    """The share of `values` within `limit` (1.0 with nothing to judge; None: no limit asked)."""
    if limit is None:
        return None
    return sum(v <= limit for v in values) / len(values) if values else 1.0


def rank(scored: Sequence[Scored]) -> list[Scored]:
    stall = lambda s: s.metrics.stall_ms.p90 if s.metrics.stall_ms.p90 is not None else 0.0  # noqa: E731
    return sorted(scored, key=lambda s: (not s.meets, -s.goodput_per_worker, stall(s)))


# what layer-wise streaming must gain over the same split's bulk pull to rank ahead of it
STREAM_GAIN = 0.01


def simpler_first(ranked: Sequence[Scored]) -> list[Scored]:
    """`ranked` with each layer-wise candidate moved behind its bulk twin (the same split, the KV
    pulled whole) unless it earns its moving parts: goodput up, or TTFT or stall p90 down, by
    STREAM_GAIN. Where the simulator finds them equal the measurements did not: on the 2-core EPYC VM
    (2026-12-05, `plan-verify-{article-h,chat-h,mixed-h,article-i,mixed-i}`) the bulk twin measured
    2-12% more goodput in four of five such pairs, the layer-wise one 2% more in the fifth; in the last
    two the layer-wise decode pool's steps ran 1.15-1.17x their price, the bulk one's 1.01-1.02x. What
    the per-layer pulls cost the workers' steps is not priced; until it is, a tie goes to fewer moving
    parts. (Set after those runs: the rule is fitted to them.)"""
    out = list(ranked)
    for s in ranked:
        if s.candidate.kv_transfer != "layerwise":
            continue
        twin = next((t for t in out if t.candidate == replace(s.candidate, kv_transfer="bulk")), None)
        if twin is None or out.index(s) > out.index(twin) or _earns(s, twin):
            continue
        out.remove(s)
        out.insert(out.index(twin) + 1, s)
    return out


def _earns(s: Scored, twin: Scored) -> bool:
    if s.goodput_per_worker > twin.goodput_per_worker * (1 + STREAM_GAIN):
        return True
    pairs = ((s.metrics.ttft_ms.p90, twin.metrics.ttft_ms.p90), (s.metrics.stall_ms.p90, twin.metrics.stall_ms.p90))
    return any(a is not None and b is not None and a < b * (1 - STREAM_GAIN) for a, b in pairs)


def _scaled(fit: StepCostFit | None, k: float) -> StepCostFit | None:
    """`fit` with every term `k` times its price."""
    if fit is None:
        return None
    return fit.scaled(k)


def fit_error(setup: cp.PredictionSetup) -> float | None:
    """The step fits' own relative error (the largest), None without a fit."""
    errs = [f.rms_rel_error for f in (setup.steps.fit, setup.steps.prefill_fit, setup.steps.prompt_fit) if f]
    known = [e for e in errs if e is not None]
    return max(known) if known else None


def priced_at(setup: cp.PredictionSetup, k: float, decode_k: float | None = None) -> cp.PredictionSetup:
    """`setup` with every term of its step fits `k` times its price (a datasheet model: unchanged);
    with `decode_k`, a step that decodes alone `decode_k` times instead (StepModel.decode_pace)."""
    st = setup.steps
    steps = replace(
        st, fit=_scaled(st.fit, k), prefill_fit=_scaled(st.prefill_fit, k), prompt_fit=_scaled(st.prompt_fit, k),
        decode_pace=st.decode_pace * (decode_k / k if decode_k else 1.0),
    )  # fmt: skip
    return replace(setup, steps=steps)


def interval(
    s: Scored, setup: cp.PredictionSetup, specs: list[RequestSpec], slos: Slos, max_num_seqs: int, err: float
) -> dict[str, tuple[float | None, float | None]]:
    """`s`'s figures with every step priced `err` lower and higher (goodput: the other way round)."""
    out: dict[str, list[float | None]] = {
        k: [] for k in ("ttft_p90_ms", "tpot_p90_ms", "stall_p90_ms", "goodput_per_worker")
    }
    for k in (1 - err, 1 + err):
        m = score(s.candidate, priced_at(setup, k), specs, slos, max_num_seqs)
        out["ttft_p90_ms"].append(m.metrics.ttft_ms.p90)
        out["tpot_p90_ms"].append(m.metrics.tpot_ms.p90)
        out["stall_p90_ms"].append(m.metrics.stall_ms.p90)
        out["goodput_per_worker"].append(m.goodput_per_worker)
    return {k: (v[0], v[1]) for k, v in out.items()}


def goodput_interval(s: Scored) -> tuple[float, float] | None:
    """`s`'s goodput per worker at either end of its price error, low first (None: not priced)."""
    low, high = (s.interval or {}).get("goodput_per_worker", (None, None))
    return (min(low, high), max(low, high)) if low is not None and high is not None else None


def toss_up(a: Scored, b: Scored) -> bool:
    """Whether `b`'s goodput range reaches `a`'s: on these figures neither is surely better."""
    if not a.interval or not b.interval:
        return False
    a_low = min(x for x in a.interval["goodput_per_worker"] if x is not None)
    b_high = max(x for x in b.interval["goodput_per_worker"] if x is not None)
    return b_high >= a_low
