"""A predicted document stall with the steps' own scatter in it.

A stall is the longest gap the in-flight streams see while a document is admitted and prefilled:
the longest of the steps in that window. Simulated, every step costs its price; measured, each runs
a little over or under it (the serving loop, and on a CPU the kernel sharing two workers' cores),
and the longest of many scattered steps is longer than the longest price. On the 2-core EPYC VM a
disaggregated decode worker's steps beside a 512-token prefill ran 65-87 ms against a median of
68, the longest 87 and 100 over the two documents, where the simulator's every step, and so its
stall, was 56 (`transfer-schedule-b-zf`, 2026-12-07); in the source run of the same fits the stalls
were 71 and 66 against steps of median 53-54 (`demo-replay-zf`). A whole prompt's stall is one step
and barely moves; a window of many like steps is where the scatter tells.

So each step of the window (a gap every stream in flight shares: the simulated streams step
together) is drawn at its price plus e, e drawn from the scatter the calibration measured, in
seconds (`same_shape_scatter`), and the document's stall is its median over DRAWS draws: a figure
of the same kind as the one measured, the longest of the window's steps as they ran. Added, not
scaled: drawn as a share of each step instead, a probe's decode scatter (p90 +26% of a 37 ms step)
put a chunked-64 article's stall p90 at 652 ms where it measured 499 and its plain price said 498
(`plan-verify-article-loose-probe-y`, 2026-12-07): a long step does not scatter in proportion
(as `bench probe`'s own stall forecast found, costmodel/fit/probe_fit.py `stall_forecast`).
Seeded by the document's place in the workload: the same prediction every time.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import replace
from statistics import median

import numpy as np

from costmodel.fit.probe_fit import longest_of_draws
from costmodel.serve_metrics import DocumentStall, RequestRecord, ServeMetrics, summarize

DRAWS = 201
MIN_GROUP = 3  # steps of one shape needed to read their scatter against their median
MAX_SAMPLES = 512  # a calibration keeps at most this many (evenly spaced over them, in order)


def same_shape_scatter(groups: Iterable[Sequence[tuple[float, float]]]) -> tuple[float, ...]:
    """Seconds each step ran over (or under) its group's typical price for its shape: a group is
    steps of one kind as (seconds, fitted price), and a step's typical price is its fitted price
    times the group's median ratio of the two, so neither the fit's error on the kind nor a
    slowdown the whole group ran at is counted as scatter. Groups of fewer than MIN_GROUP steps
    tell nothing."""
    out: list[float] = []
    for g in groups:
        pairs = [(float(y), float(p)) for y, p in g if y > 0 and p > 0]
        if len(pairs) >= MIN_GROUP:
            mid = median(y / p for y, p in pairs)
            out += [y - mid * p for y, p in pairs]
    return thinned(out)


def thinned(values: Sequence[float]) -> tuple[float, ...]:
    """At most MAX_SAMPLES of `values`, evenly spaced, rounded to 0.1 us (a calibration file's size)."""
    vals = list(values)
    if len(vals) > MAX_SAMPLES:
        vals = [vals[round(i * (len(vals) - 1) / (MAX_SAMPLES - 1))] for i in range(MAX_SAMPLES)]
    return tuple(round(v, 7) for v in vals)


def window_steps(doc: RequestRecord, records: Sequence[RequestRecord]) -> list[float]:
    """The steps (seconds) of `doc`'s stall window: each gap of a stream in flight that overlaps
    [sent, first token], one per step (streams that step together share it: the longest taken)."""
    a, f = doc.send_s, doc.chunk_times_s[0]
    steps: dict[float, float] = {}
    for r in records:
        t = r.chunk_times_s
        if r is doc or not r.ok or len(t) < 2 or a is None or not t[0] < a < t[-1]:
            continue
        i = bisect_right(t, a) - 1  # the gap t[i] -> t[i + 1] holds the arrival (a plan has thousands)
        while i + 1 < len(t) and t[i] < f:
            end, gap = t[i + 1], t[i + 1] - t[i]  # simulated streams that step together share its end exactly
            if gap > steps.get(end, 0.0):
                steps[end] = gap
            i += 1
    return list(steps.values())


def jittered_stall(steps: Sequence[float], scatter: Sequence[float], seed: int, draws: int = DRAWS) -> float:
    """The median over `draws` of the longest of `steps`, each plus a draw of `scatter` (seconds)."""
    return float(np.median(longest_of_draws(steps, scatter, draws, seed)))


def with_scatter(m: ServeMetrics, records: Sequence[RequestRecord], scatter: Sequence[float]) -> ServeMetrics:
    """`m` with each document's stall drawn with `scatter` (module docstring); as it is without one."""
    if not scatter or not m.documents:
        return m
    by_id = {r.request_id: r for r in records}
    docs: list[DocumentStall] = []
    for i, d in enumerate(m.documents):
        steps = window_steps(by_id[d.request_id], records) if d.stall_s is not None else []
        docs.append(replace(d, stall_s=jittered_stall(steps, scatter, seed=i)) if steps else d)
    stalls = [d.stall_s for d in docs if d.stall_s is not None]
    return replace(m, documents=docs, stall_ms=summarize(stalls, 1000.0))
