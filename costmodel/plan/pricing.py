"""Which fit prices which candidate (`setup_for`), and what the plan says about how far those fits
cover the workload (`coverage_notes`): prompts or batches beyond what the calibration measured,
several workers on one host priced from a server with fewer, a chunk size that was not run."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from costmodel.plan.candidates import Candidate
from costmodel.plan.score import Scored
from costmodel.sim import compare_predict as cp
from costmodel.workloads import RequestSpec

# a workload prompt (or a winner's batch) this many times the calibration's gets a note: extrapolated
EXTRAPOLATE = 1.5


def kind_key(c: Candidate) -> str:
    """The calibration kind that prices `c` exactly: its mode, with its workers where several."""
    return f"{c.mode} x{c.decode}" if shared_host(c) else c.mode


def shared_host(c: Candidate) -> bool:
    """Several colocated workers: on one CPU host they contend for its cores and memory."""
    return c.mode in ("colocated", "chunked") and c.decode > 1


def setup_for(
    c: Candidate, by_kind: Mapping[str, cp.PredictionSetup] | None, default: cp.PredictionSetup
) -> cp.PredictionSetup:
    """The device model that prices `c`: the fit to a server of its kind and worker count (a
    chunked one: run at `c`'s chunk size, else the nearest size run, by ratio, the smaller on a
    tie), else of its kind, else `default` (a `bench compare` result's colocated fit, or a
    calibration file). A chunk size's own fit matters: a fit to 128-token chunks sees every prompt
    step at n = 128, so it cannot tell a chunk's per-token cost from its fixed cost, nor its
    attention pairs from its prefix read; it priced 256-token chunks of 1,024-token prompts 1.5x
    over (docs/plan.md, "Risk, not margin; chunk sizes priced by their own fit")."""
    if not by_kind:
        return default
    exact = by_kind.get(c.label) or nearest_chunk(c, by_kind)
    return exact or by_kind.get(kind_key(c)) or by_kind.get(c.mode) or default


def nearest_chunk(c: Candidate, by_kind: Mapping[str, cp.PredictionSetup]) -> cp.PredictionSetup | None:
    """The fit of the chunk size run nearest `c`'s (same workers), None for other candidates or none run."""
    if c.mode != "chunked" or c.chunk is None:
        return None
    tail = f" x{c.decode}" if c.decode > 1 else ""
    sizes = []
    for key in by_kind:
        head, _, rest = key.partition(" ")
        size, _, n = rest.partition(" ")
        if head == "chunked" and size.isdigit() and (f" {n}" if n else "") == tail:
            sizes.append(int(size))
    if not sizes:
        return None
    best = min(sizes, key=lambda s: (abs(math.log(s / c.chunk)), s))  # type: ignore[operator]
    return by_kind[f"chunked {best}{tail}"]


def coverage_notes(
    ranked: Sequence[Scored],
    cands: Sequence[Candidate],
    specs: Sequence[RequestSpec],
    setup: cp.PredictionSetup,
    by_kind: Mapping[str, cp.PredictionSetup] | None,
) -> list[str]:
    """One line for each way the calibration does not cover what the plan priced with it."""
    notes = []
    setups = [setup, *(by_kind or {}).values()]
    longest = max(s.prompt_len for s in specs)
    measured = [s.longest_prompt for s in setups if s.longest_prompt]
    if measured and longest > EXTRAPOLATE * min(measured):
        notes.append(
            f"the workload's prompts reach {longest} tokens, its calibration's measured prompts {min(measured)}: "
            "attention and context costs are extrapolated (calibrate on prompts as long as the workload's)"
        )
    elif measured and EXTRAPOLATE * longest < min(measured):
        notes.append(
            f"the calibration's prompts reach {min(measured)} tokens, the workload's {longest}: a prompt's attention "
            "was priced at longer contexts, where on a CPU each pair costs more (a lone retrieval prompt's TTFT read "
            "18-26% long this way; calibrate on prompts as long as the workload's)"
        )
    batches = [s.largest_batch for s in setups if s.largest_batch]
    if batches and ranked[0].peak_batch > EXTRAPOLATE * min(batches):
        notes.append(
            f"the winner decodes up to {ranked[0].peak_batch} requests at once on a worker, its calibration's steps "
            f"at most {min(batches)}: step prices at those batches are extrapolated (calibrate with as many streams)"
        )
    unmatched = sorted({c.label for c in cands if by_kind and shared_host(c) and kind_key(c) not in by_kind})
    if unmatched:
        notes.append(
            f"{len(unmatched)} candidates with several workers on one host ({', '.join(unmatched[:3])}"
            f"{', ...' if len(unmatched) > 3 else ''}) are priced from servers with fewer: on one CPU host "
            "workers contend for cores and memory (calibrate a server with as many: bench compare --decode N)"
        )
    if not by_kind and "bench probe" in setup.source:
        notes.append(
            "colocated whole is deployed with its prompt steps on the router's spare core too (--prompt-threads "
            "auto), which a probe of another server does not price: its figures here are pessimistic (on the 2-core "
            "VM whole prompts ran at 0.66x a chunk-256 server's probed price, plan-verify-rag-probe-k)"
        )
    w = ranked[0].candidate
    if by_kind and w.mode == "chunked" and w.label not in by_kind and (near := nearest_chunk(w, by_kind)):
        notes.append(
            f"the winner's chunk size ({w.chunk}) was not run: priced by {near.source} "
            f"(calibrate it: bench compare --chunk-sizes {w.chunk})"
        )
    return notes
