"""Workers on one host's CPU cores: what each worker's steps cost beside the others'.

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

Two colocated workers on one host (`bench compare --decode 2`) contend the same way: a step costs
`peer_slowdown` times its lone price for the share of it another worker ran a step of at most
PEER_CONTENDING_TOKENS prompt tokens (a decode step or a chunk). Measured on the kept steps of
compare-article-x2-zg and compare-rag-x2-zk (2-core AMD EPYC VM, 2026-12-07), per batch size: a
one-stream decode step ran 16.1 ms alone, 18.4 beside the other worker's decode step; 25.3 and
29.9 in the rag run; beside the other worker's whole 500-2,000-token prompt it ran at its lone
price (a long prompt's step is compute-bound; the decode steps, two at once, share the memory
bus). The verified runs' timed passes: +16% to +31% beside decode steps and chunks of 64-512
tokens, +0-5% beside whole 1,024-token prompts.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence

from benchmarks.client.logged_step import LoggedStep, overlap
from benchmarks.compare.calibrate.fit_trim import trimmed_fit
from costmodel.fit.step_fit import StepCostFit
from costmodel.sim.model import PEER_CONTENDING_TOKENS

MIN_LONE_READS = 3  # lone decode steps of one batch size that price its steps beside a prefill
ITERATIONS = 4  # _read_slowdown's rounds of reading the slowdown and refitting at lone prices


def at_lone_prices(steps: Sequence[LoggedStep], shares: Sequence[float], k: float) -> tuple[StepCostFit, int]:
    """`steps` fitted at lone prices (and how many the fit trimmed): each step's seconds divided by
    the slowdown `k` charged for its share (`shares`, one a step) that ran beside the other work."""
    return trimmed_fit([(s.shape, s.seconds / (1.0 + (k - 1.0) * sh)) for s, sh in zip(steps, shares)])


def peer_shares(steps: Sequence[LoggedStep], peers: Sequence[LoggedStep]) -> list[float]:
    """Each of `steps`' share during which a step of another worker among `peers` ran, of those
    that contend (at most PEER_CONTENDING_TOKENS prompt tokens)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for p in peers:
        if p.shape.prefill_tokens <= PEER_CONTENDING_TOKENS:
            spans.setdefault(p.worker, []).append((p.end_unix_s - p.seconds, p.end_unix_s))
    busy = {w: _merged([x for v, xs in spans.items() if v != w for x in xs]) for w in {s.worker for s in steps}}
    return [_covered(s.end_unix_s - s.seconds, s.end_unix_s, busy[s.worker]) / s.seconds if s.seconds > 0 else 0.0
            for s in steps]  # fmt: skip


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """`spans` as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _covered(start: float, end: float, merged: list[tuple[float, float]]) -> float:
    """Seconds of [start, end] inside the disjoint sorted intervals `merged`."""
    i = max(0, bisect.bisect_right(merged, (start, float("inf"))) - 1)
    total = 0.0
    while i < len(merged) and merged[i][0] < end:
        total += max(0.0, min(end, merged[i][1]) - max(start, merged[i][0]))
        i += 1
    return total


def peer_slowdown(
    steps: Sequence[LoggedStep], peers: Sequence[LoggedStep], f: StepCostFit, trimmed: int
) -> tuple[float | None, StepCostFit, int]:
    """A colocated pool of several workers on one host: how many times its lone price a step costs
    beside another worker's contending step, with the pool's fit made again at lone prices (as
    `beside_decode_slowdown`; None where fewer than 3 steps ran alone or 3 beside)."""
    if len({s.worker for s in peers}) < 2:
        return None, f, trimmed
    return _read_slowdown(steps, peer_shares(steps, peers), f, trimmed)


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
    lone prices (each step's seconds divided by its slowdown) and what that fit trimmed. (None, `f`,
    `trimmed`): fewer than 3 steps alone or 3 beside decoding."""
    return _read_slowdown(steps, [overlap(s, decoding) for s in steps], f, trimmed)


def _read_slowdown(
    steps: Sequence[LoggedStep], shares: Sequence[float], f: StepCostFit, trimmed: int
) -> tuple[float | None, StepCostFit, int]:
    """The slowdown of `steps` for the share of each (`shares`) that ran beside the other work, read
    as the median price ratio of the steps at least half beside it against the lone steps' median,
    per share: 1 + (ratio - 1) / share; and the fit made again at lone prices with it, until they
    agree. (None, `f`, `trimmed`): fewer than 3 of either."""
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
        f, trimmed = at_lone_prices(steps, shares, k)
    return k, f, trimmed
