"""Two workers on one host's CPU cores: what each pool's steps cost beside the other's.

On separate GPUs a disaggregated run's prefill and decode workers do not slow each other; on one
host's CPU cores they compete, and each pool's steps are priced at lone prices times a slowdown for
the share of them the other pool ran beside: a decode step beside a prefill step
(`beside_prefill_slowdown`), a prefill step beside decoding (`beside_decode_slowdown`, with the
prefill pool's fit made again at lone prices, `at_lone_prices`).

A prefill pool reads its own slowdown only with three lone steps and three beside decoding; a
`bench compare --decode 2` calibration's prefill pool has a handful of steps, so its fit mixed the
two and the simulator charged nothing beside decoding. `calibration.fit_steps` then borrows the
decode pool's slowdown and refits the prefill pool at lone prices with it. Measured, re-priced
from the kept steps (`pdserve plan --reprice benchmarks/results/plan-verify`, 2026-12-07, 2-core
AMD EPYC VM): the disaggregated rounds of runs article/mixed-i, -zg and -zj (12) went from a mean
goodput error of +4.9% to +0.9%, within 10% from 10 to 12; in runs zg the prefill steps had run
1.16-1.31x their price beside decoding and 1.03-1.18x alone. The demo's calibrations, whose
prefill pools had the steps, read their own 1.16-1.31 against the decode pool's 1.01-1.14: the
borrowed figure is the lower of the two.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from benchmarks.client.logged_step import LoggedStep, overlap
from benchmarks.compare.calibrate.fit_trim import trimmed_fit
from costmodel.fit.step_fit import StepCostFit

MIN_LONE_READS = 3  # lone decode steps of one batch size that price its steps beside a prefill
ITERATIONS = 4  # beside_decode_slowdown's rounds of reading the slowdown and refitting at lone prices


def at_lone_prices(steps: Sequence[LoggedStep], decoding: Sequence[LoggedStep], k: float) -> tuple[StepCostFit, int]:
    """A prefill pool's `steps` fitted at lone prices (and how many the fit trimmed): each step's
    seconds divided by the slowdown `k` charged for the share of it that `decoding` ran beside."""
    shares = [overlap(s, decoding) for s in steps]
    return trimmed_fit([(s.shape, s.seconds / (1.0 + (k - 1.0) * sh)) for s, sh in zip(steps, shares)])


def beside_prefill_slowdown(steps: Sequence[LoggedStep], decode: StepCostFit | None) -> float:
    """How many times its own price a decode step costs while a prefill step runs beside it: 1 on
    separate GPUs; on one host's CPU cores the two pools compete (measured 1.5-3x on 2 cores).
    The median over decode steps at least half overlapped of 1 + (ratio - 1) / share, the ratio
    against the median lone step of its batch size (MIN_LONE_READS of them; else the fit): the fit
    is linear in the batch, the steps are not (the demo's one- and two-stream steps both ran 15.4
    ms, priced 15.5 and 18.1: two-stream steps beside a prefill read 0.92x, not 1.09x, 2026-12-06)."""
    prefill = [s for s in steps if s.role == "prefill"]
    if decode is None or not prefill:
        return 1.0
    decoding = [(s, overlap(s, prefill)) for s in steps if s.role == "decode"]
    lone: dict[int, list[float]] = {}
    for s in (s for s, share in decoding if share == 0.0):
        lone.setdefault(s.shape.decode_seqs, []).append(s.seconds)
    reads = []
    for s, share in decoding:
        if share >= 0.5:
            kin = lone.get(s.shape.decode_seqs, [])
            base = statistics.median(kin) if len(kin) >= MIN_LONE_READS else decode.seconds(s.shape)
            reads.append(1.0 + (s.seconds / base - 1.0) / share)
    return max(1.0, statistics.median(reads)) if len(reads) >= 3 else 1.0


def beside_decode_slowdown(
    steps: Sequence[LoggedStep], decoding: Sequence[LoggedStep], f: StepCostFit, trimmed: int
) -> tuple[float | None, StepCostFit, int]:
    """How many times its lone price a prefill step costs while decode steps run beside it (a
    disaggregated run's pools share a CPU's cores: a 2,058-token document's prefill ran 7.4 s
    beside four decoding chats, 6.6 s mostly alone, 2026-12-05), with the pool's fit made again at
    lone prices (each step's seconds divided by its slowdown) and what that fit trimmed. Read as the
    median price ratio of the steps at least half overlapped against the lone steps' median, per
    share of overlap: 1 + (ratio - 1) / share. (None, `f`, `trimmed`): fewer than 3 of either."""
    shares = [overlap(s, decoding) for s in steps]
    lone = [i for i, sh in enumerate(shares) if sh == 0.0]
    beside = [i for i, sh in enumerate(shares) if sh >= 0.5]
    if len(lone) < 3 or len(beside) < 3:
        return None, f, trimmed
    k = 1.0
    for _ in range(ITERATIONS):  # the fit moves toward lone prices, the ratios with it
        ratios = [s.seconds / max(f.seconds(s.shape), 1e-9) for s in steps]
        base = statistics.median(ratios[i] for i in lone)
        k = max(1.0, statistics.median(1.0 + (ratios[i] / base - 1.0) / shares[i] for i in beside))
        if k == 1.0:
            break
        f, trimmed = at_lone_prices(steps, decoding, k)
    return k, f, trimmed
