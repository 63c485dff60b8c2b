"""Self-calibration for `bench compare`: the step-cost model fitted to the server's own steps.

A prediction is only as good as the step prices it runs on. A calibration file made earlier (on
another machine, or before an engine change) prices steps that no longer exist, and nothing in
the prediction says so. So by default each mode is predicted from the steps that very server ran
in its warm-up, in the same run:

- `step_log.StepLogRecorder` polls `GET /v1/workers/steps` (each worker's last 256 steps: shape and
  seconds) through the warm-up and keeps every step once;
- `fit_pools` fits the four-term step model (`costmodel/fit/step_fit.py`) per pool: colocated workers'
  steps into one fit; a disaggregated run's prefill and decode workers apart, because on a CPU
  they share cores and each pool's steps must be priced as they ran beside the other. A pool whose
  prompt steps ran on more intra-op threads than its decode steps (a colocated worker's
  --prompt-threads) has those steps priced apart (`fit_beside`): in the one fit they mixed two
  machines (`make demo`, 2026-12-05: colocated max stall predicted 1,219 ms, measured 593);
- `hop_ms` times what a warm request waits beyond its worker's queue and prefill (HTTP/SSE,
  router, Ray hops), from a few requests sent one at a time after the warm-up
  (`side_requests.hop_specs`): the warm-up's own requests queue behind each other; lone shorter
  documents and prompts past a cached prefix (`side_requests`) give the fit other prompt shapes.

Each fit leaves out the steps that ran cold (`fit_trim.py`); a disaggregated run's two pools on
one host's cores are priced beside each other as `contention.py` reads it.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks.client.logged_step import LoggedStep, from_table, overlap, steps_table
from benchmarks.compare.calibrate.contention import at_lone_prices, beside_decode_slowdown, beside_prefill_slowdown
from benchmarks.compare.calibrate.fit_trim import trimmed_fit
from benchmarks.compare.calibrate.scatter import decode_scatter
from costmodel.fit.step_fit import StepCostFit, fit_beside
from costmodel.sim import compare_predict as cp
from costmodel.sim.compare_predict import PredictionSetup
from engine.config import PROMPT_STEP_TOKENS

MIN_STEPS = 8  # fewer steps than this and a pool's fit is not trusted


@dataclass(frozen=True)
class PoolFit:
    """One pool's step-cost fit and what it was fitted on."""

    pool: str  # "colocated" | "prefill" | "decode"
    fit: StepCostFit
    steps: int  # steps the fit kept
    trimmed: int  # cold or disturbed steps dropped (see the module docstring)
    torch_threads: int | None = None  # intra-op threads its steps ran with (the most common; None: unknown)
    # prompt steps that ran on other threads than `torch_threads`, fitted apart (see split_by_threads)
    prompt_fit: StepCostFit | None = None
    prompt_threads: int | None = None
    prompt_steps: int = 0
    # a disaggregated prefill pool on the decode pool's cores: its steps cost this many times the
    # fit's (lone) price for the share of them a decode step ran beside (`beside_decode_slowdown`);
    # None: not read (too few lone steps or too few beside decoding to tell them apart)
    beside_slowdown: float | None = None
    beside_borrowed: bool = False  # not read: the decode pool's beside a prefill (`fit_steps`)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "beside_slowdown": self.beside_slowdown,
            "beside_borrowed": self.beside_borrowed,
            "steps": self.steps,
            "trimmed": self.trimmed,
            "torch_threads": self.torch_threads,
            "fit": self.fit.to_dict(),
            "prompt_threads": self.prompt_threads,
            "prompt_steps": self.prompt_steps,
            "prompt_fit": self.prompt_fit.to_dict() if self.prompt_fit else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PoolFit:
        """A pool fit as `to_dict` wrote it (an earlier `bench compare` result's)."""
        prompt = d.get("prompt_fit")
        return cls(
            d["pool"],
            StepCostFit.from_dict(d["fit"]),
            int(d["steps"]),
            int(d.get("trimmed", 0)),
            d.get("torch_threads"),
            StepCostFit.from_dict(prompt) if prompt else None,
            d.get("prompt_threads"),
            int(d.get("prompt_steps", 0)),
            None if (k := d.get("beside_slowdown", 1.0)) is None else float(k),
            bool(d.get("beside_borrowed", False)),
        )


def fit_pools(steps: Sequence[LoggedStep]) -> dict[str, PoolFit]:
    """A fit per pool role that ran at least MIN_STEPS steps. A decode pool is fitted on its steps
    that ran while no prefill step did, where there are enough of them: the others are priced by
    `beside_prefill_slowdown`. A prefill pool is fitted at lone prices where it has lone steps and
    steps beside decoding to tell them apart (`beside_decode_slowdown`)."""
    by_role: dict[str, list[LoggedStep]] = {}
    for s in steps:
        if s.seconds > 0:
            by_role.setdefault(s.role, []).append(s)
    decoding = list(by_role.get("decode", []))
    if "decode" in by_role and "prefill" in by_role:
        alone = [s for s in by_role["decode"] if overlap(s, by_role["prefill"]) == 0.0]
        if len(alone) >= MIN_STEPS:
            by_role["decode"] = alone
    out = {}
    for role, logged in by_role.items():
        base, prompt = split_by_threads(logged)
        if len(base) < MIN_STEPS:
            continue
        f, trimmed = trimmed_fit([(s.shape, s.seconds) for s in base])
        k = None
        if role == "prefill" and decoding:
            k, f, trimmed = beside_decode_slowdown(base, decoding, f, trimmed)
        pool = PoolFit(role, f, len(base) - trimmed, trimmed, threads_of(base), beside_slowdown=k)
        if prompt:
            pf = fit_beside([(s.shape, s.seconds) for s in prompt], f)
            pool = replace(pool, prompt_fit=pf, prompt_threads=threads_of(prompt), prompt_steps=pf.samples)
        out[role] = pool
    return out


def fit_steps(steps: Sequence[LoggedStep]) -> tuple[dict[str, PoolFit], float]:
    """What a calibration fits from its steps: a fit per pool, and a decode step's slowdown beside
    a prefill (`build` on a fresh warm-up, `SelfCalibration.refitted` on kept steps)."""
    pools = fit_pools(steps)
    decode = pools.get("decode")
    k = beside_prefill_slowdown(steps, decode.fit if decode else None)
    p = pools.get("prefill")
    if p is not None and p.beside_slowdown is None and k > 1.0:
        # too few steps to read its own slowdown beside decoding (a `--decode 2` calibration's
        # prefill pool has a handful): the decode pool's, the same two workers on the same cores,
        # and its fit made again at lone prices with it (benchmarks/compare/calibrate/contention.py)
        base, _ = split_by_threads([s for s in steps if s.role == "prefill" and s.seconds > 0])
        f, trimmed = at_lone_prices(base, [s for s in steps if s.role == "decode" and s.seconds > 0], k)
        pools["prefill"] = replace(p, fit=f, steps=len(base) - trimmed, trimmed=trimmed, beside_slowdown=k,
                                   beside_borrowed=True)  # fmt: skip
    return pools, k


def split_by_threads(steps: Sequence[LoggedStep]) -> tuple[list[LoggedStep], list[LoggedStep]]:
    """`steps` as (the pool's steps, its prompt steps that ran on other threads). The pool's
    threads are those of its short steps (fewer than PROMPT_STEP_TOKENS prompt tokens); a step
    with prompt tokens on another count is a prompt step (engine/runner/model_runner.py picks the
    threads by the prompt's length: from PROMPT_STEP_TOKENS today, --prompt-threads-min-tokens on a
    server told otherwise, 64 before 2026-12-06), priced by `fit_beside` (even one: left in, it
    would skew the pool's fit)."""
    short = threads_of([s for s in steps if s.shape.prefill_tokens < PROMPT_STEP_TOKENS])
    prompt = [s for s in steps if s.shape.prefill_tokens > 0 and s.torch_threads > 0 and s.torch_threads != short]
    if short is None or not prompt:
        return list(steps), []
    taken = {id(s) for s in prompt}
    return [s for s in steps if id(s) not in taken], prompt


def threads_of(steps: Sequence[LoggedStep]) -> int | None:
    """The intra-op thread count most of `steps` ran with (None if the server reported none)."""
    counts = Counter(s.torch_threads for s in steps if s.torch_threads > 0)
    return counts.most_common(1)[0][0] if counts else None


@dataclass
class SelfCalibration:
    """What `bench compare` measured on one server to predict that server."""

    pools: dict[str, PoolFit]
    hop_ms: float | None  # a warm request's wait beyond its worker's queue and prefill (median)
    hop_requests: int
    link_gbytes_per_s: float | None  # disagg: the KV pulls of the warm-up (model's KV bytes / time)
    recorder_error: str | None = None
    decode_slowdown_beside_prefill: float = 1.0  # disagg on shared cores (beside_prefill_slowdown)
    notes: list[str] = field(default_factory=list)
    longest_prompt: int | None = None  # tokens: the warm-up's longest prompt (beyond it the fit extrapolates)
    largest_batch: int | None = None  # the most sequences a step decoded (beyond it the fit extrapolates)
    logged: list[LoggedStep] = field(default_factory=list)  # the warm-up's steps the fits were made from

    def refitted(self) -> SelfCalibration:
        """This calibration with its pools fitted again, by this version's step model, from the
        warm-up steps it kept (a result written before it kept them: as it is)."""
        if not self.logged:
            return self
        pools, slowdown = fit_steps(self.logged)
        return replace(self, pools=pools, decode_slowdown_beside_prefill=slowdown)

    @property
    def decode_fit(self) -> StepCostFit | None:
        p = self.pools.get("decode") or self.pools.get("colocated")
        return p.fit if p else None

    @property
    def prefill_fit(self) -> StepCostFit | None:
        p = self.pools.get("prefill")
        return p.fit if p else None

    @property
    def prefill_slowdown_beside_decode(self) -> float:
        p = self.pools.get("prefill")
        return p.beside_slowdown if p and p.beside_slowdown is not None else 1.0

    @property
    def prompt_fit(self) -> tuple[StepCostFit, int] | None:
        """The colocated pool's prompt steps on their own threads: (fit, threads), or None."""
        p = self.pools.get("colocated")
        return (p.prompt_fit, p.prompt_threads or 0) if p and p.prompt_fit else None

    @property
    def steps(self) -> int:
        return sum(p.steps + p.prompt_steps for p in self.pools.values())

    @property
    def torch_threads(self) -> int | None:
        """The threads the decode-side pool's steps ran with (every pool has --threads-per-worker's)."""
        p = self.pools.get("decode") or self.pools.get("colocated")
        return p.torch_threads if p else None

    def usable_for(self, mode: str) -> bool:
        need = ("prefill", "decode") if mode == "disagg" else ("colocated",)
        return all(r in self.pools for r in need)

    def summary(self) -> str:
        """One line for the progress log."""
        if not self.pools:
            return "none (" + "; ".join(self.notes + ([self.recorder_error] if self.recorder_error else [])) + ")"
        pools = ", ".join(
            f"{k} {p.steps} steps ({p.trimmed} trimmed{f', {p.torch_threads} threads' if p.torch_threads else ''})"
            + (f" + {p.prompt_steps} prompt steps on {p.prompt_threads} threads" if p.prompt_fit else "")
            for k, p in self.pools.items()
        )
        hop = f"{self.hop_ms:.1f} ms" if self.hop_ms is not None else "not measured"
        link = f", KV pulls at {self.link_gbytes_per_s:.2f} GB/s" if self.link_gbytes_per_s else ""
        k, kp = self.decode_slowdown_beside_prefill, self.prefill_slowdown_beside_decode
        beside = f", decode steps {k:.2f}x beside a prefill" if k > 1.0 else ""
        borrowed = (p := self.pools.get("prefill")) is not None and p.beside_borrowed
        beside += f", prefill steps {kp:.2f}x beside decoding" + " (the decode pool's)" * borrowed if kp > 1.0 else ""
        return f"{pools}; serving hop {hop}{link}{beside}"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SelfCalibration:
        """A self-calibration as `to_dict` wrote it into an earlier `bench compare` result."""
        return cls(
            {k: PoolFit.from_dict(p) for k, p in d["pools"].items()},
            d.get("hop_ms"),
            int(d.get("hop_requests", 0)),
            d.get("link_gbytes_per_s"),
            d.get("recorder_error"),
            float(d.get("decode_slowdown_beside_prefill", 1.0)),
            list(d.get("notes", [])),
            d.get("longest_prompt"),
            d.get("largest_batch"),
            from_table(d.get("warmup_steps")),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": "self: the server's own warm-up steps (GET /v1/workers/steps)",
            "pools": {k: p.to_dict() for k, p in self.pools.items()},
            "steps": self.steps,
            "torch_threads": self.torch_threads,
            "hop_ms": self.hop_ms,
            "hop_requests": self.hop_requests,
            "link_gbytes_per_s": self.link_gbytes_per_s,
            "decode_slowdown_beside_prefill": self.decode_slowdown_beside_prefill,
            "recorder_error": self.recorder_error,
            "notes": self.notes,
            "longest_prompt": self.longest_prompt,
            "largest_batch": self.largest_batch,
            "warmup_steps": steps_table(self.logged),
        }


def hop_ms(records: Sequence[Any]) -> tuple[float | None, int]:
    """Median over finished requests of client TTFT minus the worker's queue and prefill (ms)."""
    hops = [
        (r.chunk_times_s[0] - r.send_s) * 1e3 - r.worker_queue_ms - r.worker_prefill_ms
        for r in records
        if r.ok and r.send_s is not None and r.worker_queue_ms is not None and r.worker_prefill_ms is not None
    ]
    return (statistics.median(hops) if hops else None), len(hops)


def link_rate(records: Sequence[Any], kv_bytes_per_token: int) -> float | None:
    """GB/s at which the warm-up's KV pulls moved the model's KV of their prompts: the simulator
    prices a pull as prompt tokens x KV bytes per token / rate, so the rate is fitted in those
    terms (block padding and per-pull latency included)."""
    pulls = [
        (r.prompt_tokens or r.prompt_len) * kv_bytes_per_token / (r.transfer["ms"] / 1e3)
        for r in records
        if r.transfer and r.transfer.get("ms")
    ]
    return statistics.median(pulls) / 1e9 if pulls else None


def build(
    steps: Sequence[LoggedStep],
    warmup_records: Sequence[Any],
    hop_records: Sequence[Any],
    kv_bytes_per_token: int,
    recorder_error: str | None = None,
) -> SelfCalibration:
    """The self-calibration of one server from what its warm-up and hop requests measured."""
    hop, n = hop_ms(hop_records)
    pools, slowdown = fit_steps(steps)
    cal = SelfCalibration(pools, hop, n, link_rate(warmup_records, kv_bytes_per_token), recorder_error, slowdown)
    cal.logged = list(steps)
    cal.longest_prompt = max((r.n_in for r in warmup_records if getattr(r, "ok", False)), default=None)
    cal.largest_batch = max((s.shape.decode_seqs for s in steps), default=0) or None
    if not cal.pools:
        cal.notes.append(f"no pool ran {MIN_STEPS} steps in the warm-up ({len(steps)} steps seen)")
    return cal


def prediction_setup(model: str, mode: str, cal: SelfCalibration | None) -> tuple[PredictionSetup | None, str | None]:
    """The simulator's device model from a server's self-calibration, or why there is none."""
    if cal is None:
        return None, "no self-calibration (the server's steps were not recorded)"
    if not cal.usable_for(mode):
        have = ", ".join(f"{k} {p.steps}" for k, p in cal.pools.items()) or "none"
        return None, f"too few warm-up steps to fit every pool of a {mode} run (steps per pool: {have})"
    decode = cal.decode_fit
    assert decode is not None  # usable_for checked the pools
    src = f"self-calibrated: fitted to {cal.steps} steps this server ran in its warm-up " + ", ".join(
        f"{k} {p.steps}" for k, p in cal.pools.items()
    )
    setup = cp.setup_from_steps(
        model,
        decode,
        cal.prefill_fit,
        cal.link_gbytes_per_s,
        src,
        cal.steps,
        torch_threads=cal.torch_threads,
        prompt_fit=cal.prompt_fit,
    )
    setup = replace(
        setup, longest_prompt=cal.longest_prompt, largest_batch=cal.largest_batch,
        step_scatter_s=decode_scatter(cal.logged, decode),
    )  # fmt: skip
    k = cal.decode_slowdown_beside_prefill
    return replace(setup, decode_slowdown=k, prefill_slowdown=cal.prefill_slowdown_beside_decode), None
