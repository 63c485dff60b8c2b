"""The probe's measurements, each a black-box experiment over HTTP (see benchmarks/probe/command.py).

- overhead: a 1-token prompt, max_tokens=1, on the idle server: HTTP + scheduling + one tiny step;
- decode step: b streams started together, ignore_eos, closed once all b have decoded side by side
  for a while; the step is the streams' median pace while all b decode (after the last one's first
  token), and the serving jitter what each step's longest gap over the streams adds to that pace;
- prefill: one prompt of T tokens alone, max_tokens=1; its TTFT (costmodel/fit/probe_fit.py fits the
  differences from the shortest prompt's, so the request's own overhead cancels);
- the tax: b streams decoding, then one T-token prompt; the longest gap the streams saw while it
  was prefilled (the stall, costmodel/serve_metrics.py's definition) and the tokens they lost;
- prefix caching: the same prompt twice;
- a chunk at an offset (on a server whose prefix cache the check above saw, prompts as token ids):
  a prompt of `start` tokens, then the same tokens and `n` fresh ones after them: the server
  computes only those, in one step at that offset, as it would a chunk of a longer prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median

from benchmarks.client.serve_client import StreamRecord
from benchmarks.probe.client import ProbeClient, ProbeError, checked
from costmodel.fit.probe_fit import CachedChunk, DecodePoint
from costmodel.serve_metrics import RequestRecord, document_stall


@dataclass(frozen=True)
class Overhead:
    ttft_s: float  # median TTFT of a 1-token prompt, max_tokens=1, idle server
    samples: list[float]


@dataclass(frozen=True)
class PrefillSample:
    tokens: int
    ttft_s: float  # median over repeats
    ttfts_s: list[float]
    server_prefill_ms: float | None  # the server's own figure, when it reports one (pdserve timeline)


@dataclass(frozen=True)
class DecodeSample:
    batch: int
    prompt_tokens: int
    point: DecodePoint
    gaps: int  # inter-token gaps inside the window the streams' paces were taken over
    first_to_second_token_s: float  # median: a disaggregated server's KV transfer shows up here
    # per step in that window: the longest gap over the streams less their pace. What a stall (the
    # longest gap any stream sees) adds to the step that causes it: the client's reads, the HTTP
    # path and the server's own hiccups, as this server and machine produce them
    step_residuals_s: list[float] = field(default_factory=list)
    run_paces_s: list[float] = field(default_factory=list)  # each run's median pace, in pass order


@dataclass(frozen=True)
class TaxSample:
    batch: int
    tokens: int
    stall_s: float | None  # None: no stream was in flight when the prompt arrived
    tokens_lost: float
    prompt_ttft_s: float
    stream_step_s: float  # the streams' median pace before the prompt arrived
    steps_during: float  # median count of stream tokens that arrived while the prompt was prefilled
    excess_s: float  # median over streams of the time they lost in that window (vs their own pace)
    # median over streams of their longest gap in it: all streams freeze for a whole prompt, while
    # one stream's hiccup (another process on shared cores) moves only the max, the stall
    median_gap_s: float | None = None


@dataclass(frozen=True)
class PrefixCache:
    tokens: int
    first_ttft_s: float
    second_ttft_s: float
    # the server's usage said so (prompt_tokens_details.cached_tokens > 0 on the second), or, where
    # it reports no count, the second prefill (TTFT less the request overhead) took under half the first
    cached: bool
    reported_cached_tokens: int | None = None  # the second request's usage count, where the server gives one


async def overhead(c: ProbeClient, repeats: int) -> Overhead:
    await c.send(1, 1)  # warm-up (first request: connection setup, lazy init on the server)
    ts = [checked(await c.send(1, 1)).ttft_s for _ in range(repeats)]
    return Overhead(median(ts), ts)


async def prefill(c: ProbeClient, tokens: int, repeats: int) -> PrefillSample:
    recs = [checked(await c.send(tokens, 1)) for _ in range(repeats)]
    server = [r.worker_prefill_ms for r in recs if r.worker_prefill_ms is not None]
    return PrefillSample(
        recs[0].n_in, median(r.ttft_s for r in recs), [r.ttft_s for r in recs], median(server) if server else None
    )


async def decode_passes(
    c: ProbeClient,
    points: list[tuple[int, int]],
    max_tokens: int,
    passes: int,
    on_run: Callable[[int, int, int, float], None] = lambda k, b, ctx, pace: None,
) -> list[DecodeSample]:
    """Every (batch, prompt tokens) point once per pass, the order reversed on every other pass,
    each point's runs then pooled: the median pace over every stream of every run, so a hiccup of
    the machine in one run moves a few paces, not the result.

    Why passes, not a point's repeats back to back: a lone stream's step on a 2-core VM wandered
    29-44 ms from one 32-token run to the next with no pattern (2026-12-07), and the long-context
    points, measured last and once, carried that into the per-context-token term: probe zg read
    its lone long-context step 1.46x its short one, a rerun 1.07x, and the plans it fed priced
    long-context decode 15% high. Reversed passes put every point at the same mean time, so drift
    over the minutes the points take lands on all alike; four probes of one server, old and new
    alternated, read that ratio 1.34x and 1.38x the old way, 1.15x and 1.17x in passes (the
    server's own step log agreeing; docs/results.md). `on_run(pass, batch, prompt, pace)` reports
    each run as it ends."""
    runs: dict[tuple[int, int], list[_DecodeRun]] = {p: [] for p in points}
    for k in range(passes):
        for b, ctx in points if k % 2 == 0 else points[::-1]:
            run = await _decode_once(c, b, ctx, max_tokens)
            runs[(b, ctx)].append(run)
            on_run(k, b, ctx, median(run.paces))
    return [_pooled(b, runs[(b, ctx)]) for b, ctx in points]


def _pooled(batch: int, runs: list[_DecodeRun]) -> DecodeSample:
    paces = [p for r in runs for p in r.paces]
    ctx = sum(x for r in runs for x in r.contexts) / sum(len(r.contexts) for r in runs)
    return DecodeSample(
        batch,
        runs[0].prompt_tokens,
        DecodePoint(batch, ctx, median(paces)),
        sum(r.gaps for r in runs),
        median(s for r in runs for s in r.second_s),
        [x for r in runs for x in r.residuals_s],
        [median(r.paces) for r in runs],
    )


@dataclass(frozen=True)
class _DecodeRun:
    prompt_tokens: int
    paces: list[float]  # each stream's pace over the window
    contexts: list[float]  # each stream's mean context over it
    gaps: int
    second_s: list[float]  # each stream's first-to-second-token gap
    residuals_s: list[float]  # per step: the longest gap over the streams less the median pace


async def _decode_once(c: ProbeClient, batch: int, prompt_tokens: int, tokens: int) -> _DecodeRun:
    """b streams started together, closed by the probe once all b have decoded `tokens` tokens side
    by side. Not by max_tokens: on a chunked server the b prompts are prefilled one chunk at a time,
    so the first stream decodes (beside the others' chunks) long before the last one starts, and
    streams of `tokens` tokens would never all decode at once. The cap, `prompt` tokens more,
    covers the (b - 1) x prompt / chunk steps the last one starts after, for any chunk of at least
    b - 1 tokens; a whole-prompt server is closed after `tokens` as before (a lone stream waits
    for nobody: `tokens` is its cap)."""
    cap = tokens + (prompt_tokens if batch > 1 else 0)
    specs = [c.spec(prompt_tokens, cap, "probe") for _ in range(batch)]
    live = [c.record(s) for s in specs]  # send_one fills them in place while they stream
    tasks = [asyncio.create_task(c.run(s, r)) for s, r in zip(specs, live)]
    ended: list[RequestRecord] = []
    try:
        while _side_by_side(live) < tokens and not (ended := [r for r, t in zip(live, tasks) if t.done()]):
            await asyncio.sleep(0.005)
    finally:
        for t in tasks:
            t.cancel()
        # unchecked while they run: one failure raised out of gather would leave the others'
        # errors unretrieved (a traceback at exit instead of one line)
        await asyncio.gather(*tasks, return_exceptions=True)
    recs = live
    # a stream stopped short (an error, or fewer tokens than asked) says why the others were closed
    # before all decoded; one that ran to its cap is a server running streams one after another
    for r in (r for r in ended if r.error or r.n_out < cap):
        checked(r)
        raise ProbeError(
            f"request {r.request_id} ended after {r.n_out} of {cap} tokens before all {batch} streams "
            f"of {prompt_tokens}-token prompts decoded side by side: the server stopped it early (a context or "
            "KV limit?); lower --max-batch or --max-context"
        )
    for r in recs:
        if r.error and r.error.startswith("cancelled"):
            r.error = None  # closed by the probe, on purpose
        checked(r)
        if len(r.chunk_times_s) < 3:
            raise ProbeError(
                f"a stream asked for {cap} tokens (ignore_eos) streamed {len(r.chunk_times_s)}: "
                "the server ignores ignore_eos or does not stream token by token"
            )
    lo = max(r.chunk_times_s[0] for r in recs)  # all b decoding from here...
    hi = min(r.chunk_times_s[-1] for r in recs)  # ...until the first one ends
    # The step is each stream's pace over that window (its span over the tokens in it), not the
    # median gap: a client short of CPU reads tokens in bursts, and a burst's gaps are near zero
    # while the span between its ends stays true. Median over the streams.
    paces, ctxs, windows = [], [], []
    for r in recs:
        inside = [t for t in r.chunk_times_s if lo <= t <= hi]
        if len(inside) >= 3:
            paces.append((inside[-1] - inside[0]) / (len(inside) - 1))
            ctxs.append(r.n_in + r.chunk_times_s.index(inside[0]) + len(inside) / 2)
            windows.append(inside)
    gaps = sum(len([t for t in r.chunk_times_s if lo <= t <= hi]) - 1 for r in recs)
    if not paces:  # the streams barely overlapped (a server that runs them one after another)
        paces = [(r.chunk_times_s[-1] - r.chunk_times_s[1]) / (len(r.chunk_times_s) - 2) for r in recs]
        ctxs = [r.n_in + len(r.chunk_times_s) / 2 for r in recs]
        gaps = sum(len(r.chunk_times_s) - 2 for r in recs)
    second = [r.chunk_times_s[1] - r.chunk_times_s[0] for r in recs]
    return _DecodeRun(recs[0].n_in, paces, ctxs, gaps, second, step_residuals(windows, median(paces)))


def _side_by_side(live: list[RequestRecord]) -> int:
    """Tokens every stream has had since the last of them started (0 until all have)."""
    if not all(r.chunk_times_s for r in live):
        return 0
    lo = max(r.chunk_times_s[0] for r in live)
    return min(sum(t >= lo for t in r.chunk_times_s) for r in live)


def step_residuals(windows: list[list[float]], pace_s: float) -> list[float]:
    """Per step, the longest gap over the streams less the pace. The streams decode in the same
    steps, so their k-th gaps in the window (from the same start) are one step seen by each."""
    if not windows:
        return []
    steps = min(len(w) for w in windows) - 1
    return [max(w[k + 1] - w[k] for w in windows) - pace_s for k in range(steps)]


async def tax(
    c: ProbeClient, batch: int, tokens: int, stream_prompt: int, step_guess_s: float, http_overhead_s: float
) -> TaxSample:
    """b streams decode; once each has a few tokens, one `tokens` prompt arrives; once each stream
    has a few tokens after its first token, the streams are closed (the server aborts them).

    The prompt's prefill is taken to start `http_overhead_s` after it was sent (the request's own
    HTTP and scheduling time, during which the streams decode as usual)."""
    # The streams are closed by the probe, never by max_tokens: 2,000 fits any context window we
    # probe and outlasts any prefill that finishes within the timeouts below.
    specs = [c.spec(stream_prompt, 2000, "chat") for _ in range(batch)]
    live = [c.record(s) for s in specs]  # send_one fills them in place while they stream
    tasks = [asyncio.create_task(c.run(s, r)) for s, r in zip(specs, live)]
    recs: list[RequestRecord] = []
    try:
        await _until(lambda: all(len(r.chunk_times_s) >= 6 for r in live), tasks, 60 + 20 * step_guess_s)
        doc = checked(await c.send(tokens, 1, "document"))
        f = doc.chunk_times_s[0]
        await _until(lambda: all(sum(t > f for t in r.chunk_times_s) >= 3 for r in live), tasks, 30 + 10 * step_guess_s)
        recs = live
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for r in recs:
        if r.error and r.error.startswith("cancelled"):
            r.error = None  # closed by the probe, on purpose
        checked(r)
    d = document_stall(doc, recs)
    s0, f = doc.send_s or 0.0, doc.chunk_times_s[0]
    # Each stream's own pace before the prompt arrived (span over tokens, from its second token:
    # bursts of tokens read together do not fool it, as they fool a median gap).
    # Floored at half the fitted step: a client starved of CPU can read all of them in one burst.
    paces = [max(_pace([t for t in r.chunk_times_s[1:] if t < s0]), 0.5 * step_guess_s) for r in recs]
    step = median(paces)
    # Tokens lost: the longest gap (document_stall's) at the stream's own pace, less the one token it delivers.
    lost = sum(max(0.0, st.gap_s / p - 1.0) for st, p in zip(d.streams, paces) if p > 0)
    during = [sum(s0 + http_overhead_s < t <= f + 1e-3 for t in r.chunk_times_s) for r in recs]
    # The time each stream lost while the prompt was in the server: from its last token before the
    # prompt to its first after the prompt's first token, less the tokens it got at its own pace.
    excess = []
    for r, p in zip(recs, paces):
        before = [t for t in r.chunk_times_s if t <= s0]
        after = [t for t in r.chunk_times_s if t > f]
        if before and after:
            n = sum(before[-1] < t <= after[0] for t in r.chunk_times_s)
            excess.append(max(0.0, after[0] - before[-1] - n * p))
    gaps = [st.gap_s for st in d.streams]
    return TaxSample(
        batch,
        doc.n_in,
        d.stall_s,
        lost,
        doc.ttft_s,
        step,
        float(median(during)),
        float(median(excess or [0.0])),
        median(gaps) if gaps else None,
    )


def _pace(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) >= 2 else 0.0


async def prefix_cache(c: ProbeClient, tokens: int, http_overhead_s: float, pairs: int = 2) -> PrefixCache:
    """The same fresh prompt twice, `pairs` times. A server that reports
    `usage.prompt_tokens_details.cached_tokens` (OpenAI, vLLM, SGLang, pdserve) says itself whether
    the second hit its cache. Otherwise timing decides: the pair whose second TTFT fell most (one
    pair can be hit by another job's burst on a shared machine), cached when its second prefill
    (TTFT less the request overhead) took under half the first's."""
    runs = []
    for _ in range(pairs):
        prompt, n = c.prompt(tokens)
        first = checked(await c.run(c.spec(n, 1, "probe", prompt)))
        second = checked(await c.run(c.spec(n, 1, "probe", prompt)))
        ratio = max(0.0, second.ttft_s - http_overhead_s) / max(1e-9, first.ttft_s - http_overhead_s)
        runs.append((ratio, first, second))
    ratio, first, second = min(runs, key=lambda x: x[0])
    told = [s.cached_tokens for _, _, s in runs if isinstance(s, StreamRecord) and s.cached_tokens is not None]
    if told:
        return PrefixCache(first.n_in, first.ttft_s, second.ttft_s, max(told) > 0, max(told))
    return PrefixCache(first.n_in, first.ttft_s, second.ttft_s, ratio < 0.5)


async def cached_chunk(c: ProbeClient, start: int, tokens: int, repeats: int) -> CachedChunk | None:
    """`tokens` fresh tokens after a `start`-token prefix the server has just cached: its TTFT,
    median over `repeats` (a fresh prefix each). None when the server said it cached less than
    the prefix's whole blocks (then the step was not the chunk asked for)."""
    ttfts = []
    for _ in range(repeats):
        prefix, n = c.prompt(start)
        checked(await c.run(c.spec(n, 1, "probe", prefix)))
        tail, m = c.prompt(tokens)
        assert isinstance(prefix, tuple) and isinstance(tail, tuple)  # token ids: text would re-tokenize the seam
        rec = checked(await c.run(c.spec(n + m, 1, "probe", prefix + tail)))
        told = rec.cached_tokens if isinstance(rec, StreamRecord) else None
        if told is not None and told < start - 64:  # 64: four 16-token blocks of slack at the seam
            return None
        ttfts.append(rec.ttft_s)
    return CachedChunk(start, tokens, float(median(ttfts)))


async def _until(cond, tasks, timeout_s: float) -> None:
    """Wait for `cond()`; a stream that ended early (the server died, or ended it) is an error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        done = [t for t in tasks if t.done()]
        if done:
            rec = done[0].result()
            raise ProbeError(f"a decoding stream ended early: {rec.error or rec.finish_reason}")
        if loop.time() > deadline:
            raise ProbeError(f"the streams made no progress within {timeout_s:.0f} s")
        await asyncio.sleep(0.005)
