"""One step fit for the servers of one `bench compare` run that ran the same forward on the same threads.

A colocated server and a chunked one of the same worker count run one engine: every decode step,
the chunked server's prompt chunks and the colocated server's short prompts on the same intra-op
thread. Their steps follow one cost function, but each server's own fit carries two accidents of
its warm-up:

- the pace the machine ran at in those minutes: two servers of one run on the 2-core EPYC VM had
  their decode steps 1.04x apart (`compare-chat24-v`) and 1.12x (`compare-chat24-u`);
- the shapes its schedule happened to give: a chunked server's prompt steps are almost all whole
  chunks, so its fit cannot tell a chunk's fixed cost from its tokens (chunk-256's fit in
  `compare-chat24-v` put 21.7 ms on each prompt item, the colocated server's 6.5 ms; the plan's
  shared-prefix chat, whose prompt steps carry 64 fresh tokens each, then ran at 0.88x its price).

Where the servers are priced for another workload (`--transfer-from`, `pdserve plan --calibration`),
their steps are therefore pooled into one fit per worker count and thread count (`pooled`); a
colocated server's prompt steps on more threads keep their own fit, refitted beside the pooled one.
A run's own replay predictions keep each server's own fit: there the warm-up is the timed run's.
Measured effect on the 2-core EPYC VM (2026-12-06, the verified plans whose calibrations kept their
steps, re-predicted offline): goodput error median 7.7% -> 5.1%, mean 16.6% -> 10.6% over 29 rows,
attainment error mean 12.8 -> 7.4 points (docs/plan.md, "One fit for one engine").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from benchmarks.client.logged_step import LoggedStep
from benchmarks.compare.calibrate.calibration import (
    MIN_STEPS,
    SelfCalibration,
    split_by_threads,
    threads_of,
    trimmed_fit,
)
from costmodel.fit.step_fit import fit_beside


@dataclass(frozen=True)
class Server:
    """One colocated-kind server of a run (chunked or not), as its result records it."""

    label: str
    cal: SelfCalibration
    workers: int


def pooled(servers: Mapping[str, Server]) -> dict[str, tuple[SelfCalibration, list[str]]]:
    """label -> (its calibration with the pooled fit, the labels pooled with) for each server that
    shares a worker count and decode threads with another that kept its steps; the others are left
    out (priced by their own fit)."""
    groups: dict[tuple[int, int | None], list[tuple[Server, list[LoggedStep], list[LoggedStep]]]] = {}
    for s in servers.values():
        own = [x for x in s.cal.logged if x.role == "colocated" and x.seconds > 0]
        base, prompt = split_by_threads(own)
        if "colocated" in s.cal.pools and len(base) >= MIN_STEPS:
            groups.setdefault((s.workers, threads_of(base)), []).append((s, base, prompt))
    out: dict[str, tuple[SelfCalibration, list[str]]] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        steps = [x for _, base, _ in members for x in base]
        joint, trimmed = trimmed_fit([(x.shape, x.seconds) for x in steps])
        labels = [s.label for s, _, _ in members]
        for s, _, prompt in members:
            pool = replace(s.cal.pools["colocated"], fit=joint, steps=len(steps) - trimmed, trimmed=trimmed)
            if prompt and pool.prompt_fit is not None:
                try:
                    pool = replace(pool, prompt_fit=fit_beside([(x.shape, x.seconds) for x in prompt], joint))
                except ValueError:  # the shared fit prices every prompt step's other terms past its time
                    pass  # its own prompt fit, beside its own fit, stands
            out[s.label] = (replace(s.cal, pools={**s.cal.pools, "colocated": pool}), labels)
    return out
