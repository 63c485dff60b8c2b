"""One probe of one server: the measurements in order, then the fits and the article's tables.

`await probe(client, plan, log)` returns a `ProbeResult`; nothing here prints to stdout (progress
goes through `log`, which the CLI points at stderr).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any

from benchmarks import probe_measure as pm
from benchmarks.probe_client import ProbeClient
from benchmarks.probe_plan import ProbePlan
from costmodel import probe_fit as pf
from costmodel.step_fit import StepCostFit


@dataclass(frozen=True)
class Chunking:
    verdict: str  # "whole", "chunked", "disaggregated", "no interference" or "unknown"
    chunk_tokens: float | None  # the inferred chunk (or token budget), when chunked
    why: str


@dataclass
class ProbeResult:
    base_url: str
    model: str
    prompts: str  # "ids" or "text"
    plan: ProbePlan
    overhead: pm.Overhead
    http_overhead_s: float  # the overhead minus one batch-1 decode step (the step it ran)
    decode: list[pm.DecodeSample]
    prefill: list[pm.PrefillSample]
    tax: list[pm.TaxSample]
    prefix: pm.PrefixCache | None
    decode_fit: pf.DecodeFit
    prefill_fit: pf.PrefillFit
    step_fit: StepCostFit
    chunking: Chunking
    wall_s: float = 0.0

    @property
    def stall_chunk(self) -> int | None:
        c = self.chunking.chunk_tokens
        return round(c) if self.chunking.verdict == "chunked" and c else None

    @property
    def prefill_elsewhere(self) -> bool:
        return self.chunking.verdict in ("disaggregated", "no interference")

    def predict_stall(self, batch: int, context: int, tokens: int) -> float:
        """The stall the fit predicts for this server as inferred: the step carrying the whole
        prompt or its costliest chunk, or (prefill in another pool) the decode step alone; a
        prefill pool sharing the decode pool's cores is not modelled."""
        if self.prefill_elsewhere:
            return self.step_fit.decode_seconds([context] * batch)
        return pf.predicted_stall(self.step_fit, batch, context, tokens, self.stall_chunk)

    def tables(self) -> dict[str, Any]:
        """The article's tables for this server (costmodel/probe_fit.py)."""
        df, fp = self.decode_fit, self.prefill_fit
        ctx = self.plan.contexts[-1]
        big_b = self.plan.batches[-1]
        headline = [
            {
                "prompt_tokens": t,
                "batch": b,
                "prefill_ms": fp.seconds(t) * 1e3,
                "decode_step_ms": df.seconds(b, ctx) * 1e3,
                "generated_tokens": pf.prompt_in_generated_tokens(fp, df, t, b, ctx),
            }
            for t in self.plan.prefill_tokens
            for b in sorted({1, big_b})
        ]
        chunks = [
            {"chunk": c, "chunk_ms": fp.seconds(c) * 1e3, "decode_steps": pf.decode_steps_per_chunk(fp, df, c, ctx)}
            for c in (32, 64, 128, 256, 512)
        ]
        doc = self.plan.max_context
        cap = [asdict(r) for r in pf.capacity(fp, doc, big_b)]
        stalls = [
            {
                "batch": t.batch,
                "prompt_tokens": t.tokens,
                "measured_stall_ms": None if t.stall_s is None else t.stall_s * 1e3,
                "predicted_stall_ms": self.predict_stall(t.batch, self.plan.short_prompt + 8, t.tokens) * 1e3,
                "tokens_lost": t.tokens_lost,
            }
            for t in self.tax
        ]
        pl = self.plan
        article_mix = {
            "chat_streams": pl.mix_streams,
            "doc_prompt_tokens": pl.mix_doc_tokens,
            "context": pl.mix_context,
            "chunk": self.stall_chunk,
            "prefill_elsewhere": self.prefill_elsewhere,
            "predicted_stall_ms": self.predict_stall(pl.mix_streams, pl.mix_context, pl.mix_doc_tokens) * 1e3,
        }
        be = pf.break_even_chunk(fp, df, ctx)
        return {
            "context": ctx,
            "headline": headline,
            "break_even_chunk": None if math.isinf(be) else be,
            "chunks": chunks,
            "capacity_prompt_tokens": doc,
            "capacity_batch": big_b,
            "capacity": cap,
            "stalls": stalls,
            "article_mix": article_mix,
        }

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["step_fit"] = self.step_fit.to_dict()
        d["tables"] = self.tables()
        return d


def infer_chunking(
    tax: list[pm.TaxSample], prefill_fit: pf.PrefillFit, handoff_s: float = 0.0, step_s: float = 0.0
) -> Chunking:
    """From the tax at the longest prompt, against that prompt's fitted prefill time P:

    - the streams' longest gap (less one step; the median stream's, so that one stream's hiccup
      does not count) is most of P: one step carried the whole prompt ("whole");
    - else the prompt ran in pieces beside the decode steps. If those steps ran slower than the
      streams' own pace (by over 10%), the pieces rode in the decode steps: chunked, at about
      T / (the steps the streams got while it ran), the median over every (b, T) probed. If not,
      the prefill ran beside decode without slowing it ("no interference": disaggregated, or
      prefill on capacity decode does not use).

    A lone stream whose second token comes well after its first (`handoff_s`, over twice the
    batch-1 step `step_s`) had its KV moved between pools: "disaggregated", whatever the streams'
    slowdown (on shared cores the prefill pool still takes the decode pool's CPU).

    From outside a chunk and a per-step token budget look alike; the size is an estimate."""
    if not tax:
        return Chunking("unknown", None, "no tax was measured")
    t = max(tax, key=lambda x: (x.tokens, x.batch))
    p = prefill_fit.seconds(t.tokens)
    if p <= 0 or t.stall_s is None:
        return Chunking("unknown", None, "no prefill time or no stream in flight to judge by")
    spike = ((t.median_gap_s if t.median_gap_s is not None else t.stall_s) - t.stream_step_s) / p
    slowdown = t.excess_s / max(1.0, t.steps_during) / t.stream_step_s
    seen = (
        f"a {t.tokens}-token prompt (prefill alone {p * 1e3:.0f} ms): longest gap of {t.batch} streams "
        f"{t.stall_s * 1e3:.0f} ms, {t.steps_during:g} tokens each while it ran, {slowdown:.0%} slower than their pace"
    )
    if spike > 0.5:
        return Chunking("whole", None, f"{seen}: one step carried the whole prompt")
    if step_s > 0 and handoff_s > 2 * step_s:
        return Chunking(
            "disaggregated",
            None,
            f"{seen}; a lone stream's first-to-second-token gap is {handoff_s * 1e3:.0f} ms against a "
            f"{step_s * 1e3:.1f} ms step: its KV moved between pools",
        )
    if slowdown < 0.1:
        return Chunking("no interference", None, f"{seen}: prefill runs beside decode (disaggregated?)")
    # T / steps at every (b, T) probed, median: one point stretched by a burst elsewhere on the
    # machine (more steps than chunks) does not move it
    sizes = [x.tokens / x.steps_during for x in tax if x.steps_during >= 2] or [t.tokens / max(1.0, t.steps_during)]
    chunk = median(sizes)
    return Chunking(
        "chunked", chunk, f"{seen}: chunks of about {chunk:.0f} tokens (median T / steps over {len(sizes)} points)"
    )


async def probe(c: ProbeClient, plan: ProbePlan, log: Callable[[str], None]) -> ProbeResult:
    await c.start()
    log(f"probe: {c.model} at {c.base_url}, prompts as {'token ids' if c.mode == 'ids' else 'text'}")
    ovh = await pm.overhead(c, plan.overhead_repeats)
    log(f"probe: idle request overhead (1-token prompt, 1 token) {ovh.ttft_s * 1e3:.1f} ms")
    decode = []
    for ctx in plan.contexts:
        for b in plan.batches:
            s = await pm.decode(c, b, ctx, plan.decode_tokens, plan.decode_repeats)
            decode.append(s)
            log(f"probe: decode b={b} prompt {s.prompt_tokens}: step {s.point.step_s * 1e3:.2f} ms ({s.gaps} gaps)")
    one = next(d for d in decode if d.batch == 1)  # batch 1 at the short context
    http = max(0.0, ovh.ttft_s - one.point.step_s)
    # batch 1 at the long context: the most KV a lone stream's first-to-second-token gap can show
    handoff = [d for d in decode if d.batch == 1][-1]
    prefill = []
    for t in plan.prefill_tokens:
        s = await pm.prefill(c, t, plan.prefill_repeats)
        prefill.append(s)
        log(f"probe: prefill T={s.tokens}: TTFT {s.ttft_s * 1e3:.1f} ms")
    df = pf.fit_decode([d.point for d in decode])
    points = [pf.PrefillPoint(p.tokens, p.ttft_s - http) for p in prefill]
    fp = pf.fit_prefill(points)
    steps = pf.fit_joint([d.point for d in decode], points)
    tax = []
    for b, t in plan.tax_points:
        runs = [
            await pm.tax(c, b, t, plan.short_prompt, df.seconds(b, plan.short_prompt), http)
            for _ in range(plan.tax_repeats)
        ]
        s = sorted(runs, key=lambda x: x.stall_s or 0.0)[len(runs) // 2]  # the median run by its stall
        tax.append(s)
        stall = "-" if s.stall_s is None else f"{s.stall_s * 1e3:.1f} ms"
        log(f"probe: tax b={b} T={s.tokens}: stall {stall}, {s.tokens_lost:.1f} tokens lost, {s.steps_during:g} steps")
    prefix = await pm.prefix_cache(c, plan.prefix_tokens, http)
    log(
        f"probe: same {prefix.tokens}-token prompt twice: TTFT {prefix.first_ttft_s * 1e3:.1f} then "
        f"{prefix.second_ttft_s * 1e3:.1f} ms ({'prefix cache' if prefix.cached else 'no prefix cache seen'})"
    )
    return ProbeResult(
        c.base_url, c.model or "", c.mode, plan, ovh, http, decode, prefill, tax, prefix, df, fp, steps,
        infer_chunking(tax, fp, handoff.first_to_second_token_s, handoff.point.step_s),
    )  # fmt: skip
