"""The article's cost model fitted to what `pdserve bench probe` measured from outside a server.

Two fits, each by non-negative least squares on *relative* error (a 5 ms step and a 500 ms
prefill count alike, as in costmodel/step_fit.py):

    decode step(b, c) = fixed + per_sequence * b + per_context_token * b * c   (c: context per stream)
    prefill(T)        = fixed + linear * T + quadratic * T^2                  (one prompt alone)

and one joint fit of costmodel/step_fit.py's four-term step model over the same points, which is
what a calibration file carries (the simulator and `bench compare` price steps with it).

From them, the article's arithmetic for that server: one T-token prompt in generated tokens at
batch b (prefill(T) / (step(b) / b)), the break-even chunk (the chunk whose prefill takes one
batch-1 decode step), decode steps lost per chunk, the capacity table, and the stall one prompt
should cause (the step that carries it beside the decode batch).

Pure arithmetic on numbers; numpy for the small solves.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from costmodel.step_fit import StepCostFit, StepShape
from costmodel.step_fit import fit as fit_steps


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    context: float  # mean context per stream (prompt + tokens generated so far) over the window
    step_s: float  # median inter-token gap once all `batch` streams decode


@dataclass(frozen=True)
class PrefillPoint:
    tokens: int
    prefill_s: float  # TTFT minus the HTTP/request overhead (see benchmarks/probe_measure.py)


def nnls_rel(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative least squares of y ~ x @ coef on relative error; (coef, rms relative error).

    Every subset of columns is solved unconstrained and the best all-non-negative one wins: exact
    NNLS for three columns (seven solves), and no scipy needed."""
    if len(y) < 1 or np.any(y <= 0):
        raise ValueError("need positive timings to fit")
    w = 1.0 / y
    xw, yw = x * w[:, None], y * w
    scale = np.maximum(np.abs(xw).max(axis=0), 1e-300)  # columns span orders of magnitude
    best: tuple[float, np.ndarray] | None = None
    k = x.shape[1]
    for n in range(1, k + 1):
        for cols in itertools.combinations(range(k), n):
            sol, *_ = np.linalg.lstsq(xw[:, cols] / scale[list(cols)], yw, rcond=None)
            if np.any(sol < 0):
                continue
            coef = np.zeros(k)
            coef[list(cols)] = sol / scale[list(cols)]
            err = float(np.sqrt(np.mean(((x @ coef - y) / y) ** 2)))
            if best is None or err < best[0]:
                best = (err, coef)
    assert best is not None  # a single column with positive y always has a non-negative solution
    return best[1], best[0]


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

    def seconds(self, tokens: float) -> float:
        return self.fixed_s + self.linear_s * tokens + self.quadratic_s * tokens * tokens


def fit_decode(points: Sequence[DecodePoint]) -> DecodeFit:
    if not points:
        raise ValueError("no decode step was measured")
    x = np.array([[1.0, p.batch, p.batch * p.context] for p in points])
    y = np.array([p.step_s for p in points])
    c, err = nnls_rel(x, y)
    return DecodeFit(float(c[0]), float(c[1]), float(c[2]), err, len(points))


def fit_prefill(points: Sequence[PrefillPoint]) -> PrefillFit:
    pts = [p for p in points if p.prefill_s > 0]
    if not pts:
        raise ValueError("no prefill was measured above the request overhead")
    x = np.array([[1.0, p.tokens, float(p.tokens) ** 2] for p in pts])
    y = np.array([p.prefill_s for p in pts])
    c, err = nnls_rel(x, y)
    return PrefillFit(float(c[0]), float(c[1]), float(c[2]), err, len(pts))


def fit_joint(decode: Sequence[DecodePoint], prefill: Sequence[PrefillPoint]) -> StepCostFit:
    """step_fit's four terms over every probed step: what the calibration file carries."""
    samples = [(StepShape.of([round(p.context)] * p.batch), p.step_s) for p in decode]
    samples += [(StepShape.of((), [(0, p.tokens)]), p.prefill_s) for p in prefill if p.prefill_s > 0]
    return fit_steps(samples)


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
    """The longest gap the `batch` streams should see while a `tokens` prompt is prefilled: the step
    that carries the prompt (whole) or its costliest chunk (the last: most attention) beside the
    decode batch."""
    size = tokens if chunk is None else max(1, min(chunk, tokens))
    chunks = [(start, min(size, tokens - start)) for start in range(0, tokens, size)]
    parts = [max(chunks, key=lambda p: p[1] * (p[0] + p[1]))]
    return steps.seconds(StepShape.of([context] * batch, parts))


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
