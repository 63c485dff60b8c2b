"""A step fit that leaves out the steps it misprices by far.

A step that ran cold (the first of its shape: allocator growth, oneDNN weight layouts) would pull
the fit up, so the fit is trimmed: steps the first fit misprices by far more than the typical step
(`TRIM_FACTOR` times the median relative error) are dropped, at most `TRIM_MAX_SHARE` of them, and
the rest refitted.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from costmodel.fit.step_fit import StepCostFit, StepShape, fit

TRIM_FACTOR = 4.0
TRIM_MAX_SHARE = 0.1


def trimmed_fit(samples: Sequence[tuple[StepShape, float]]) -> tuple[StepCostFit, int]:
    """The NNLS fit after dropping the steps it misprices by far more than the typical step."""
    first = fit(samples)
    errs = [abs(first.seconds(s) - y) / y for s, y in samples]
    typical = statistics.median(errs) or 1e-9
    worst = sorted(range(len(samples)), key=lambda i: errs[i], reverse=True)
    drop = {i for i in worst[: int(len(samples) * TRIM_MAX_SHARE)] if errs[i] > TRIM_FACTOR * typical}
    if not drop:
        return first, 0
    return fit([x for i, x in enumerate(samples) if i not in drop]), len(drop)
