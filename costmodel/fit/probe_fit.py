"""The article's cost model fitted to what `pdserve bench probe` measured from outside a server.

Two fits, each by non-negative least squares on *relative* error (a 5 ms step and a 500 ms
prefill count alike; the solver is costmodel/fit/nnls.py, step_fit's too):

    decode step(b, c) = fixed + per_sequence * b + per_context_token * b * c   (c: context per stream)
    prefill(T)        = fixed + linear * T + quadratic * T^2                  (one prompt alone)

and one joint fit of costmodel/fit/step_fit.py's four-term step model over the same points and the
tax runs' mixed steps, which is what a calibration file carries (the simulator and `bench compare`
price steps with it).

Prefill is fitted *anchored*: on differences of TTFT from the shortest prompt's, against the
difference in tokens. A request's overhead is not one constant: the router's polling and the
client's reads overlap a long prefill but not a short one, so TTFT minus the idle request's
overhead understated short prompts, the curve looked convex, and the fit put the per-token term at
zero (a 128-token chunk priced as free). Differences cancel whatever every prompt pays alike; the
fixed term is what the shortest prompt leaves over the overhead.

From them, the article's arithmetic for that server: one T-token prompt in generated tokens at
batch b (prefill(T) / (step(b) / b)), the break-even chunk (the chunk whose prefill takes one
batch-1 decode step), decode steps lost per chunk, the capacity table, and the stall one prompt
should cause: the steps that carry it beside the decode batch, each with the serving jitter the
probe measured added, the longest of them (`stall_forecast`: a median and a p90, not one number).

Pure arithmetic on numbers; numpy for the feature rows and the stall forecast's draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from costmodel.fit.nnls import nnls_rel
from costmodel.fit.step_fit import OUTSIDE_TERMS, READ_SPREAD, TERMS, StepCostFit, StepShape


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    context: float  # mean context per stream (prompt + tokens generated so far) over the window
    step_s: float  # median inter-token gap once all `batch` streams decode


@dataclass(frozen=True)
class PrefillPoint:
    tokens: int
    prefill_s: float  # TTFT minus the HTTP/request overhead (see benchmarks/probe/measure.py)


@dataclass(frozen=True)
class TTFTPoint:
    tokens: int
    ttft_s: float  # one prompt alone, max_tokens=1: the request's overhead plus its prefill


@dataclass(frozen=True)
class MixedStep:
    """A step the tax measured: `batch` streams at `context` decoding beside one piece of a
    `tokens` prompt (the whole prompt, or each of its chunks in turn: `seconds` is their mean)."""

    batch: int
    context: int
    tokens: int
    seconds: float


@dataclass(frozen=True)
class DecodeFit:
    fixed_s: float
    per_sequence_s: float
    per_context_token_s: float  # per stream per token of its context (the KV read)
    rms_rel_error: float
    points: int

    def seconds(self, batch: int, context: float) -> float:
        return self.fixed_s + self.per_sequence_s * batch + self.per_context_token_s * batch * context


@dataclass(frozen=True)
class PrefillFit:
    fixed_s: float
    linear_s: float  # per prompt token
    quadratic_s: float  # per prompt token squared (attention)
    rms_rel_error: float
    points: int
    # the prompt the TTFT differences were taken from (fit_prefill_anchored): the shortest clear of
    # the latency floor; 0: fitted on TTFT less the overhead (fit_prefill)
    anchor_tokens: int = 0

    def seconds(self, tokens: float) -> float:
        return self.fixed_s + self.linear_s * tokens + self.quadratic_s * tokens * tokens


def fit_decode(points: Sequence[DecodePoint]) -> DecodeFit:
    if not points:
        raise ValueError("no decode step was measured")
    c, err = nnls_rel([[1.0, p.batch, p.batch * p.context] for p in points], [p.step_s for p in points])
    return DecodeFit(float(c[0]), float(c[1]), float(c[2]), err, len(points))


def fit_prefill(points: Sequence[PrefillPoint]) -> PrefillFit:
    pts = [p for p in points if p.prefill_s > 0]
    if not pts:
        raise ValueError("no prefill was measured above the request overhead")
    c, err = nnls_rel([[1.0, p.tokens, float(p.tokens) ** 2] for p in pts], [p.prefill_s for p in pts])
    return PrefillFit(float(c[0]), float(c[1]), float(c[2]), err, len(pts))


FLOOR_MARGIN = 1.1  # a TTFT this far above the idle request's has risen clear of the latency floor


def clear_of_floor(points: Sequence[TTFTPoint], floor_s: float) -> list[TTFTPoint]:
    """The prompts whose TTFT rose clear of the server's latency floor (the idle 1-token request's
    TTFT), shortest first. Below it a TTFT is the floor whatever the prefill: pdserve's tiny model
    answered 128- to 512-token prompts in 47-51 ms where its own timeline put their prefill at
    8-31 ms (the router hands a first token over no sooner), so their differences are noise."""
    return sorted((p for p in points if p.ttft_s > FLOOR_MARGIN * floor_s), key=lambda p: p.tokens)


Row = tuple[np.ndarray, float, float]  # (features, seconds, what its error is relative to)


def _prompt_rows(
    points: Sequence[TTFTPoint], overhead_s: float, floor_s: float, features: Callable[[int], np.ndarray]
) -> list[Row]:
    """The prompts alone as fit rows: each one clear of the floor as its TTFT's difference from the
    shortest such prompt's, relative to its own TTFT (a difference is as noisy as the TTFTs it is
    taken between, however small it is); a lone prompt clear of it (with none, the longest) as its
    TTFT less `overhead_s`."""
    usable = clear_of_floor(points, floor_s) or sorted(points, key=lambda p: p.tokens)[-1:]
    if len(usable) == 1:
        (p,) = usable
        y = p.ttft_s - overhead_s
        return [(features(p.tokens), y, y)] if y > 0 else []
    a = usable[0]
    return [
        (features(p.tokens) - features(a.tokens), p.ttft_s - a.ttft_s, p.ttft_s)
        for p in usable[1:]
        if p.ttft_s > a.ttft_s  # a longer prompt answered sooner: noise, no evidence of a slope
    ]


def fit_prefill_anchored(points: Sequence[TTFTPoint], overhead_s: float, floor_s: float = 0.0) -> PrefillFit:
    """prefill(T) from TTFT differences to the shortest prompt clear of the latency floor (module
    docstring): linear and quadratic from TTFT(T) - TTFT(T0) against T - T0 and T^2 - T0^2; fixed
    from what TTFT(T0) leaves over `overhead_s` (never below zero). One prompt clear of the floor:
    its prefill (TTFT less the overhead) taken as linear in T. The rms error is over the rows."""
    if not points:
        raise ValueError("no prefill was measured")
    rows = _prompt_rows(points, overhead_s, floor_s, lambda t: np.array([float(t), float(t) ** 2]))
    lin = quad = err = 0.0
    if rows:
        c, err = nnls_rel([r[0].tolist() for r in rows], [r[1] for r in rows], [r[2] for r in rows])
        lin, quad = float(c[0]), float(c[1])
    used = clear_of_floor(points, floor_s) or sorted(points, key=lambda p: p.tokens)[-1:]
    a = used[0]
    fixed = max(0.0, a.ttft_s - overhead_s - lin * a.tokens - quad * a.tokens**2)
    return PrefillFit(fixed, lin, quad, err, len(used), a.tokens)


def chunks(tokens: int, chunk: int | None) -> list[tuple[int, int]]:
    """(start, n) of the pieces a prompt is prefilled in: one (whole) or one per chunk."""
    size = tokens if chunk is None else max(1, min(chunk, tokens))
    return [(s, min(size, tokens - s)) for s in range(0, tokens, size)]


def _features(steps: Sequence[StepShape]) -> np.ndarray:
    return np.sum([s.features() for s in steps], axis=0)


def _prompt_features(tokens: int, chunk: int | None) -> np.ndarray:
    """The steps that carry a prompt alone, summed."""
    return _features([StepShape.of((), [p]) for p in chunks(tokens, chunk)])


def _mixed_features(m: MixedStep, chunk: int | None) -> np.ndarray:
    """The mean of the steps that carried the prompt beside the decode batch."""
    steps = [StepShape.of([m.context] * m.batch, [p]) for p in chunks(m.tokens, chunk)]
    return _features(steps) / len(steps)


@dataclass(frozen=True)
class CachedChunk:
    """A prompt whose first `start` tokens the server's prefix cache held: only its last `tokens`
    were computed, in one step at offset `start`, as a chunk of a longer prompt is (its read of
    the cached context included). `ttft_s`: its TTFT, median over repeats."""

    start: int
    tokens: int
    ttft_s: float


def fit_joint(
    decode: Sequence[DecodePoint],
    prefill: Sequence[TTFTPoint] = (),
    mixed: Sequence[MixedStep] = (),
    chunk: int | None = None,
    overhead_s: float = 0.0,
    floor_s: float = 0.0,
    cached: Sequence[CachedChunk] = (),
) -> StepCostFit:
    """step_fit's terms over every probed step, anchored where they are used: the decode steps as
    measured; each prompt alone as its TTFT's difference from the shortest prompt's clear of the
    latency floor (the steps that carried it, whole or in `chunk`s, less that prompt's steps;
    `_prompt_rows`); the chunks computed after a cached prefix, each as its TTFT's difference from
    that same prompt's; and the tax's mixed steps, the very steps a stall is made of. What the
    calibration file carries.

    The first five terms (OUTSIDE_TERMS) from whole prompts alone: a prompt item's own path and
    its context read need chunks at known starts, which whole prompts' TTFTs do not tell apart
    (on a server that chunks, a longer prompt is more chunks and more re-reads, both folded into
    the attention term, so a smaller chunk size was priced 13-21% under: `plan-verify-rag-probe-k`,
    2026-12-06). With cached chunks at starts READ_SPREAD apart, all seven."""
    rows: list[Row] = [
        (np.array(StepShape.of([round(p.context)] * p.batch).features()), p.step_s, p.step_s)
        for p in decode
        if p.step_s > 0
    ]
    if prefill:
        rows += _prompt_rows(prefill, overhead_s, floor_s, lambda t: _prompt_features(t, chunk))
    rows += _cached_rows(cached)
    rows += [(_mixed_features(m, chunk), m.seconds, m.seconds) for m in mixed if m.seconds > 0]
    if len(rows) < 2:
        raise ValueError("need at least two timed steps to fit the step cost")
    starts = [k.start for k in cached if k.start > 0]
    terms = len(TERMS) if len(cached) >= 3 and starts and max(starts) >= READ_SPREAD * min(starts) else OUTSIDE_TERMS
    cols = [r[0][:terms].tolist() for r in rows]
    c, err = nnls_rel(cols, [r[1] for r in rows], [r[2] for r in rows])
    return StepCostFit.of_coef([*c, *[0.0] * (len(TERMS) - terms)], samples=len(rows), rms_rel_error=err)


def _cached_rows(cached: Sequence[CachedChunk]) -> list[Row]:
    """The chunks after a cached prefix as fit rows: each one's TTFT as its difference from the
    cheapest one's (the shortest prefix's smallest chunk), so the request's overhead cancels as in
    `_prompt_rows`; a difference from a whole prompt's TTFT instead mixes two noisy anchors (a
    128-token prompt answered in 234 ms beside a 64-token chunk after 256 cached in 127)."""
    if len(cached) < 2:
        return []
    a = min(cached, key=lambda k: (k.start, k.tokens))
    xa = np.array(StepShape.of((), [(a.start, a.tokens)]).features())
    return [
        (np.array(StepShape.of((), [(k.start, k.tokens)]).features()) - xa, k.ttft_s - a.ttft_s, k.ttft_s)
        for k in cached
        if k is not a and k.ttft_s > a.ttft_s
    ]


# ---- the article's arithmetic on the fitted server --------------------------------------------
def prompt_in_generated_tokens(pf: PrefillFit, df: DecodeFit, tokens: int, batch: int, context: float) -> float:
    """The article's headline: one `tokens` prompt costs this many generated tokens at `batch`."""
    return pf.seconds(tokens) / (df.seconds(batch, context) / batch)


def break_even_chunk(pf: PrefillFit, df: DecodeFit, context: float) -> float:
    """The chunk whose prefill takes one batch-1 decode step (0: the prefill's fixed cost alone is
    already longer than a decode step; inf: prefill costs nothing per token)."""
    budget = df.seconds(1, context) - pf.fixed_s
    if budget <= 0:
        return 0.0
    a, b = pf.quadratic_s, pf.linear_s
    if a <= 0:
        return budget / b if b > 0 else math.inf
    return (-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a)


def decode_steps_per_chunk(pf: PrefillFit, df: DecodeFit, chunk: int, context: float) -> float:
    return pf.seconds(chunk) / df.seconds(1, context)


def predicted_stall(steps: StepCostFit, batch: int, context: int, tokens: int, chunk: int | None = None) -> float:
    """The costliest step that carries a `tokens` prompt beside the `batch` streams: the whole
    prompt, or its costliest chunk (the last: most attention). No jitter: `stall_forecast` adds it."""
    return max(window_steps(steps, batch, context, tokens, chunk))


def window_steps(steps: StepCostFit, batch: int, context: int, tokens: int, chunk: int | None = None) -> list[float]:
    """The steps a document's stall can fall in (the stall is the longest gap of a stream in flight
    between the document's arrival and its first token): the decode step under way when it
    arrives, then each step that carries the prompt, or a piece of it, beside the streams."""
    ctxs = [context] * batch
    return [steps.decode_seconds(ctxs)] + [steps.seconds(StepShape.of(ctxs, [p])) for p in chunks(tokens, chunk)]


@dataclass(frozen=True)
class StallForecast:
    """The stall one document should cause, as a distribution over documents."""

    median_s: float
    p90_s: float
    step_s: float  # the costliest step of the window, no jitter (the former one-number prediction)
    steps: int  # steps in the window
    jitter_samples: int  # the measured jitter it was drawn from (0: none, median = p90 = step)


def stall_forecast(
    window_s: Sequence[float], jitter_s: Sequence[float], draws: int = 2000, seed: int = 0
) -> StallForecast:
    """Each step of the window plus one draw of the measured jitter (what a step's longest gap over
    the streams adds to the step), the longest of them; median and p90 over `draws` documents.
    The max over a window's steps is why a chunked document (many steps) stalls longer than its
    costliest step, and why one step's expected time understated what `bench serve` measured.
    Seeded: the same probe prints the same forecast."""
    if not window_s:
        raise ValueError("a stall needs at least one step in its window")
    w = np.asarray(window_s, dtype=float)
    if len(jitter_s) == 0:
        top = float(w.max())
        return StallForecast(top, top, top, len(w), 0)
    p50, p90 = np.percentile(longest_of_draws(window_s, jitter_s, draws, seed), [50, 90])
    return StallForecast(float(p50), float(p90), float(w.max()), len(w), len(jitter_s))


def longest_of_draws(window_s: Sequence[float], jitter_s: Sequence[float], draws: int, seed: int) -> np.ndarray:
    """Per draw, the longest of the window's steps, each plus one draw of `jitter_s` (seconds);
    seeded (the simulator's predicted stalls are drawn the same way, costmodel/sim/stall_jitter.py)."""
    w = np.asarray(window_s, dtype=float)
    rng = np.random.default_rng(seed)
    return (w + rng.choice(np.asarray(jitter_s, dtype=float), size=(draws, len(w)))).max(axis=1)


@dataclass(frozen=True)
class CapacityRow:
    prefills_per_s: float
    share: float  # of the server's time spent prefilling
    decode_sequences: float  # batch-`batch` sequences that still fit


def capacity(pf: PrefillFit, tokens: int, batch: int, shares: Sequence[float] = (0.2, 0.4, 0.8, 1.0)):
    """The article's capacity table: prefills/s that take each share of the server, and the decode
    sequences left (batch * (1 - share), at the batch's own per-sequence speed)."""
    p = pf.seconds(tokens)
    return [CapacityRow(s / p, s, batch * (1 - s)) for s in shares]
