"""Non-negative least squares on relative error: the one solver every cost fit uses.

Timings are fitted as seconds ~ features @ coef with every coefficient >= 0 (a step cannot get
cheaper for holding more), on error relative to each timing (a 7 ms chunk and a 700 ms prompt
count alike). The fits are small (three to seven terms), so the exact answer is cheap: every
subset of columns is solved unconstrained and the best all-non-negative one wins (seven terms: 127
tiny solves, ~0.05 s over a warm-up's 300 steps). Pure Python, no numpy: the router imports it
(costmodel/fit/step_fit.py's live refits).

The solves go through the weighted normal equations, each column scaled to a unit diagonal
(the terms span twelve orders of magnitude). A column the others in its subset explain to within
`COLLINEAR` of its own size (1 - R^2 below it: the same prompt length twice, one row for two
terms) makes that subset singular: it is skipped, and a smaller subset prices the data.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

COLLINEAR = 1e-12


def solve_spd(a: Sequence[Sequence[float]], b: Sequence[float], tol: float = COLLINEAR) -> list[float] | None:
    """x with a @ x = b for a symmetric positive (semi)definite `a` with a unit diagonal (scale it so),
    by elimination without pivoting; None where a pivot falls below `tol` (singular)."""
    n = len(b)
    m = [[float(v) for v in row] + [float(b[i])] for i, row in enumerate(a)]
    for col in range(n):
        piv = m[col][col]
        if not piv > tol:
            return None
        for r in range(col + 1, n):
            f = m[r][col] / piv
            if f:
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][k] * x[k] for k in range(i + 1, n))) / m[i][i]
    return x


def rms_rel_error(
    coef: Sequence[float], x: Sequence[Sequence[float]], y: Sequence[float], rel: Sequence[float]
) -> float:
    """The root mean square of (x @ coef - y) / rel."""
    tot = sum(((sum(c * float(v) for c, v in zip(coef, xr)) - yv) / r) ** 2 for xr, yv, r in zip(x, y, rel))
    return math.sqrt(tot / len(y))


def nnls_rel(
    x: Sequence[Sequence[float]], y: Sequence[float], rel: Sequence[float] | None = None
) -> tuple[list[float], float]:
    """Non-negative least squares of y ~ x @ coef on error relative to `rel` (default: y itself):
    (coef, rms relative error). Raises ValueError unless every y and rel is positive."""
    ys = [float(v) for v in y]
    rels = ys if rel is None else [float(v) for v in rel]
    if not ys or any(v <= 0 for v in ys) or any(v <= 0 for v in rels) or len(x) != len(ys) or len(rels) != len(ys):
        raise ValueError("need positive timings to fit")
    k = len(x[0])
    a = [[0.0] * k for _ in range(k)]
    b = [0.0] * k
    for xr, yv, r in zip(x, ys, rels):
        w = 1.0 / (r * r)
        xs = [float(v) for v in xr]
        for i in range(k):
            b[i] += w * xs[i] * yv
            for j in range(k):
                a[i][j] += w * xs[i] * xs[j]
    d = [math.sqrt(a[i][i]) for i in range(k)]
    best: tuple[float, list[float]] | None = None
    for n in range(1, k + 1):
        for cols in itertools.combinations(range(k), n):
            if any(d[i] == 0.0 for i in cols):  # an all-zero column prices nothing
                continue
            sol = solve_spd([[a[i][j] / (d[i] * d[j]) for j in cols] for i in cols], [b[i] / d[i] for i in cols])
            if sol is None or any(v < 0 for v in sol):
                continue
            coef = [0.0] * k
            for i, v in zip(cols, sol):
                coef[i] = v / d[i]
            err = rms_rel_error(coef, x, ys, rels)
            if best is None or err < best[0]:
                best = (err, coef)
    if best is None:
        raise ValueError("no non-negative fit: every column of the features is zero")
    return best[1], best[0]
