"""One probe of one server: the measurements in order, then the fits and the article's tables.

`await probe(client, plan, log)` returns a `ProbeResult`; nothing here prints to stdout (progress
goes through `log`, which the CLI points at stderr).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any

from benchmarks.probe import measure as pm
from benchmarks.probe.client import ProbeClient
from benchmarks.probe.plan import ArticleCheck, ProbePlan, article_check
from costmodel.fit import probe_fit as pf
from costmodel.fit.step_fit import StepCostFit

# A step that carries a piece of a prompt costs at least this share of a batch-1 decode step (it
# runs the same weights over at least as many rows), so a prompt's lone prefill has room for at
# most prefill / (this x that step) steps; more steps than ROOM_SLACK x that while the prompt was
# prefilled means it did not ride in them.
STEP_FLOOR = 0.8
ROOM_SLACK = 1.5
# pieces that ride in the streams' steps cost the streams the prompt's compute: the time they lost
# while it ran is most of its lone prefill (0.9-0.95 measured on a chunked SmolLM2 server); under
# this share, the compute ran elsewhere (0.18 for SmolLM2 disaggregated on the same 2 cores)
CARRY_MIN = 0.5


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
    seed: int = 0  # the probe's prompts' seed; also seeds the stall forecast's draws
    wall_s: float = 0.0
    cached_chunks: list[pf.CachedChunk] = field(default_factory=list)  # chunks after a cached prefix

    @property
    def stall_chunk(self) -> int | None:
        c = self.chunking.chunk_tokens
        return round(c) if self.chunking.verdict == "chunked" and c else None

    @property
    def prefill_elsewhere(self) -> bool:
        return self.chunking.verdict in ("disaggregated", "no interference")

    def jitter(self, batch: int) -> list[float]:
        """The serving jitter measured at the decode batch nearest `batch` (the stall is a max
        over the streams: more streams, a longer tail)."""
        near = min({d.batch for d in self.decode}, key=lambda b: (abs(b - batch), -b))
        return [r for d in self.decode if d.batch == near for r in d.step_residuals_s]

    def window(self, batch: int, context: int, tokens: int) -> list[float]:
        """The steps a document's stall can fall in (probe_fit.window_steps). Prefill in another
        pool: the decode steps that run while it is prefilled there, as many and as slowed as the
        tax measured (on cores the pools share, the prefill takes the decode pool's CPU)."""
        if not self.prefill_elsewhere:
            return pf.window_steps(self.step_fit, batch, context, tokens, self.stall_chunk)
        step = self.step_fit.decode_seconds([context] * batch)
        judged = [t for t in self.tax if t.tokens > 0 and t.stream_step_s > 0]
        if not judged:
            return [step]
        slow = max(0.0, median(_slowdown(t) for t in judged))
        per_token = median(t.steps_during / t.tokens for t in judged)
        return [step * (1 + slow)] * max(1, round(tokens * per_token))

    def forecast(self, batch: int, context: int, tokens: int) -> pf.StallForecast:
        """The stall one `tokens` document should cause `batch` streams at `context`: median and
        p90 over documents, the measured serving jitter included."""
        return pf.stall_forecast(self.window(batch, context, tokens), self.jitter(batch), seed=self.seed)

    def doc_ttft(self, batch: int, context: int, tokens: int) -> float:
        """A document's TTFT beside the streams: the steps that carry it, and the request's overhead."""
        w = self.window(batch, context, tokens)
        return self.http_overhead_s + sum(w if self.prefill_elsewhere else w[1:])

    def check(self) -> ArticleCheck:
        """The `bench serve --workload article` run that measures what the probe predicts: spaced
        so each document arrives while the streams decode alone, at the context of the prediction."""
        pl = self.plan
        b, ctx, t = pl.mix_streams, pl.mix_context, pl.mix_doc_tokens
        step = self.step_fit.decode_seconds([ctx] * b)
        return article_check(pl, step, self.doc_ttft(b, ctx, t))

    def tables(self) -> dict[str, Any]:
        """The article's tables for this server (costmodel/fit/probe_fit.py)."""
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
        stalls = []
        for t in self.tax:
            f = self.forecast(t.batch, self.plan.short_prompt + 8, t.tokens)
            stalls.append(
                {
                    "batch": t.batch,
                    "prompt_tokens": t.tokens,
                    "measured_stall_ms": None if t.stall_s is None else t.stall_s * 1e3,
                    "predicted_stall_ms": f.median_s * 1e3,
                    "predicted_p90_ms": f.p90_s * 1e3,
                    "tokens_lost": t.tokens_lost,
                }
            )
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
            "article_mix": self.article_mix(),
        }

    def article_mix(self) -> dict[str, Any]:
        """The forecast for the article mix, at the context its `bench serve` command runs at."""
        pl, chk = self.plan, self.check()
        f = self.forecast(pl.mix_streams, chk.context, pl.mix_doc_tokens)
        return {
            "chat_streams": pl.mix_streams,
            "doc_prompt_tokens": pl.mix_doc_tokens,
            "context": chk.context,
            "chunk": self.stall_chunk,
            "prefill_elsewhere": self.prefill_elsewhere,
            "predicted_stall_ms": f.median_s * 1e3,
            "predicted_p90_ms": f.p90_s * 1e3,
            "costliest_step_ms": f.step_s * 1e3,
            "window_steps": f.steps,
            "jitter_samples": f.jitter_samples,
            "predicted_doc_ttft_ms": self.doc_ttft(pl.mix_streams, chk.context, pl.mix_doc_tokens) * 1e3,
            "check": asdict(chk),
            "check_command": chk.command(self.base_url, self.model, self.prompts == "ids"),
        }

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["step_fit"] = self.step_fit.to_dict()
        d["tables"] = self.tables()
        return d


def _slowdown(t: pm.TaxSample) -> float:
    """How much slower the streams stepped while the prompt was in the server than before it."""
    return t.excess_s / max(1.0, t.steps_during) / t.stream_step_s


def infer_chunking(
    tax: list[pm.TaxSample],
    prefill_fit: pf.PrefillFit,
    handoff_s: float = 0.0,
    step_s: float = 0.0,
    floor_step_s: float = 0.0,
) -> Chunking:
    """From the tax at the longest prompt, against that prompt's fitted prefill time P:

    - the streams' longest gap (less one step; the median stream's, so that one stream's hiccup
      does not count) is most of P: one step carried the whole prompt ("whole");
    - else the prompt ran in pieces beside the decode steps. If those steps ran slower than the
      streams' own pace (by over 10%), the pieces rode in the decode steps: chunked, at about
      T / (the steps the streams got while it ran, less one), the median over every (b, T) probed.
      Less one: the step under way when the prompt arrives carries none of it, yet its token comes
      after the prompt was sent. Counted without it, pdserve's `--chunk-size 256` read 205-228 in
      24 of 24 probes (a 2048-token prompt in 8 chunks: 9 or 10 stream tokens), and the article
      mix's stall was predicted 15-19% short; counted with it, 256 in 22 and 228 in 2, the stall
      within 6% (docs/results.md, 2026-12-07). If not slowed, the prefill ran beside decode
      without slowing it ("no interference": disaggregated, or prefill on capacity decode does
      not use).

    Two signs say the pieces did not ride in the decode steps however much the streams slowed,
    and the server is "disaggregated" with its pools on shared cores:
    - the streams lost far less time while the prompt ran than its lone prefill takes (under
      CARRY_MIN of it): pieces riding in their steps would have cost them the prompt's compute;
      SmolLM2 1P1D on 2 cores lost 1.1 s during a 2048-token prompt whose prefill takes 6.2 s;
    - more steps ran while the prompt was prefilled than its lone prefill has room for: each step
      carrying a piece costs at least STEP_FLOOR x the batch-1 decode step (`floor_step_s`), so P
      holds at most P / that of them. This is what `pdserve serve --chunk-size 128` on SmolLM2
      (its default mode is disagg: the chunks ran in the prefill pool, on the same 2 cores) showed:
      82 decode steps during a 2048-token prompt whose lone prefill has room for about 20, read
      as "chunks of about 25 tokens" before this check. The engine gives every step `chunk_size`
      prompt tokens whatever the decode batch (engine/core/llm_engine.py, `_schedule_prefill`).

    A lone stream whose second token comes well after its first (`handoff_s`, over twice the
    batch-1 step `step_s`) suggests its KV moved between pools: with the streams unslowed, that
    makes the verdict "disaggregated". Beside chunk-shaped evidence it is no proof (pdserve's own
    `--mode colocated --chunk-size 128` showed a 237 ms gap against a 49 ms step), so the two
    together are "unknown": a planner must not map a guess to a deployment.

    From outside a chunk and a per-step token budget look alike; the size is an estimate."""
    if not tax:
        return Chunking("unknown", None, "no tax was measured")
    t = max(tax, key=lambda x: (x.tokens, x.batch))
    p = prefill_fit.seconds(t.tokens)
    if p <= 0 or t.stall_s is None:
        return Chunking("unknown", None, "no prefill time or no stream in flight to judge by")
    spike = ((t.median_gap_s if t.median_gap_s is not None else t.stall_s) - t.stream_step_s) / p
    slowdown = _slowdown(t)
    seen = (
        f"a {t.tokens}-token prompt (prefill alone {p * 1e3:.0f} ms): longest gap of {t.batch} streams "
        f"{t.stall_s * 1e3:.0f} ms, {t.steps_during:g} tokens each while it ran, {slowdown:.0%} slower than their pace"
    )
    if spike > 0.5:
        return Chunking("whole", None, f"{seen}: one step carried the whole prompt")
    handoff = (
        f"a lone stream's first-to-second-token gap is {handoff_s * 1e3:.0f} ms against a {step_s * 1e3:.1f} ms step"
        if step_s > 0 and handoff_s > 2 * step_s
        else None
    )
    if slowdown < 0.1:
        if handoff:
            return Chunking("disaggregated", None, f"{seen}; {handoff}: its KV moved between pools")
        return Chunking("no interference", None, f"{seen}: prefill runs beside decode (disaggregated?)")
    carried = t.excess_s / p
    if carried < CARRY_MIN:
        return Chunking(
            "disaggregated",
            None,
            f"{seen}; the streams lost {t.excess_s * 1e3:.0f} ms while it ran, {carried:.0%} of its lone prefill: "
            "its compute did not ride in their steps (another pool, on cores shared with theirs)",
        )
    room = p / (STEP_FLOOR * floor_step_s) if floor_step_s > 0 else math.inf
    if t.steps_during > ROOM_SLACK * room + 1:
        return Chunking(
            "disaggregated",
            None,
            f"{seen}; its lone prefill has room for at most {room:.0f} steps of >= {STEP_FLOOR:g} x the "
            f"{floor_step_s * 1e3:.1f} ms batch-1 step: it ran beside the streams' steps, not in them "
            "(another pool, on cores shared with theirs)",
        )
    # T / (steps - 1) at every (b, T) probed (the step under way at its arrival carried none of it),
    # median: one point stretched by a burst elsewhere on the machine (more steps than chunks) does
    # not move it
    sizes = [x.tokens / (x.steps_during - 1) for x in tax if x.steps_during >= 3]
    sizes = sizes or [t.tokens / max(1.0, t.steps_during - 1)]
    chunk = median(sizes)
    if handoff:  # chunk-shaped evidence, yet a late second token: the signs disagree, so say so
        return Chunking(
            "unknown",
            None,
            f"{seen}: chunks of about {chunk:.0f} tokens rode in the streams' steps, yet {handoff} "
            "(a KV hand-off, or a slow first decode step): between the bands, no verdict",
        )
    why = f"{seen}: chunks of about {chunk:.0f} tokens (median T / (steps - 1) over {len(sizes)} points)"
    return Chunking("chunked", chunk, why)


def mixed_steps(tax: list[pm.TaxSample], chunking: Chunking, context: int) -> list[pf.MixedStep]:
    """The steps that carried each tax prompt beside the streams, when they did (whole or
    chunked): the streams' pace plus the time they lost spread over those steps."""
    if chunking.verdict not in ("whole", "chunked"):
        return []
    c = round(chunking.chunk_tokens) if chunking.verdict == "chunked" and chunking.chunk_tokens else None
    return [
        pf.MixedStep(t.batch, context, t.tokens, t.stream_step_s + t.excess_s / len(pf.chunks(t.tokens, c)))
        for t in tax
        if t.stream_step_s > 0 and t.tokens > 0
    ]


async def probe(c: ProbeClient, plan: ProbePlan, log: Callable[[str], None], seed: int = 0) -> ProbeResult:
    t0 = time.perf_counter()

    def say(msg: str) -> None:  # progress, with the time so far: a slow server shows where it spends it
        log(f"probe: [{time.perf_counter() - t0:4.0f} s] {msg}")

    await c.start()
    say(f"{c.model} at {c.base_url}, prompts as {'token ids' if c.mode == 'ids' else 'text'}")
    ovh = await pm.overhead(c, plan.overhead_repeats)
    say(f"idle request overhead (1-token prompt, 1 token) {ovh.ttft_s * 1e3:.1f} ms")
    points = plan.decode_points()
    n_runs = len(points) * plan.decode_passes
    done = iter(range(1, n_runs + 1))

    def ran(k: int, b: int, ctx: int, pace: float) -> None:
        say(f"decode {next(done)}/{n_runs} (pass {k + 1}) b={b} prompt {ctx}: {pace * 1e3:.2f} ms")

    decode = await pm.decode_passes(c, points, plan.decode_tokens, plan.decode_passes, ran)
    for s in decode:
        say(f"decode b={s.batch} prompt {s.prompt_tokens}: step {s.point.step_s * 1e3:.2f} ms ({s.gaps} gaps)")
    one = next(d for d in decode if d.batch == 1)  # batch 1 at the short context
    http = max(0.0, ovh.ttft_s - one.point.step_s)
    # batch 1 at the long context: the most KV a lone stream's first-to-second-token gap can show
    handoff = [d for d in decode if d.batch == 1][-1]
    prefill = []
    for t in plan.prefill_tokens:
        sp = await pm.prefill(c, t, plan.prefill_repeats_at(t))
        prefill.append(sp)
        say(f"prefill T={sp.tokens}: TTFT {sp.ttft_s * 1e3:.1f} ms")
    df = pf.fit_decode([d.point for d in decode])
    ttfts = [pf.TTFTPoint(p.tokens, p.ttft_s) for p in prefill]
    fp = pf.fit_prefill_anchored(ttfts, http, ovh.ttft_s)
    tax = []
    for i, (b, t) in enumerate(plan.tax_points, 1):
        runs = [
            await pm.tax(c, b, t, plan.short_prompt, df.seconds(b, plan.short_prompt), http)
            for _ in range(plan.tax_repeats)
        ]
        # the lower median run by its stall: of two, the one a burst elsewhere on the machine spared
        st = sorted(runs, key=lambda x: x.stall_s or 0.0)[(len(runs) - 1) // 2]
        tax.append(st)
        stall = "-" if st.stall_s is None else f"{st.stall_s * 1e3:.1f} ms"
        say(f"tax {i}/{len(plan.tax_points)} b={b} T={st.tokens}: stall {stall}, {st.tokens_lost:.1f} tokens lost, "
            f"{st.steps_during:g} steps")  # fmt: skip
    chunking = infer_chunking(tax, fp, handoff.first_to_second_token_s, handoff.point.step_s, one.point.step_s)
    say(
        f"chunking: {chunking.verdict}"
        + (f", about {chunking.chunk_tokens:.0f} tokens" if chunking.chunk_tokens else "")
    )
    c_tokens = round(chunking.chunk_tokens) if chunking.verdict == "chunked" and chunking.chunk_tokens else None
    mixed = mixed_steps(tax, chunking, plan.short_prompt + 8)
    prefix = await pm.prefix_cache(c, plan.prefix_tokens, http, plan.prefix_pairs)
    say(
        f"same {prefix.tokens}-token prompt twice: TTFT {prefix.first_ttft_s * 1e3:.1f} then "
        f"{prefix.second_ttft_s * 1e3:.1f} ms ({'prefix cache' if prefix.cached else 'no prefix cache seen'})"
    )
    cached: list[pf.CachedChunk] = []
    if prefix.cached and c.mode == "ids":  # a chunk's cost at an offset, through the prefix cache
        points = [(start, n) for start, n in plan.cached_chunks if start + n <= plan.max_context]
        for i, (start, n) in enumerate(points, 1):
            k = await pm.cached_chunk(c, start, n, plan.cached_chunk_repeats)
            if k is not None:
                cached.append(k)
            got = f"TTFT {k.ttft_s * 1e3:.1f} ms" if k else "the server cached less than the prefix: left out"
            say(f"chunk {i}/{len(points)}: {n} tokens after a cached {start}: {got}")
    steps = pf.fit_joint([d.point for d in decode], ttfts, mixed, c_tokens, http, ovh.ttft_s, cached)
    return ProbeResult(
        c.base_url, c.model or "", c.mode, plan, ovh, http, decode, prefill, tax, prefix, df, fp, steps, chunking,
        seed, cached_chunks=cached,
    )  # fmt: skip
