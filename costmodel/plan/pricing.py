"""Which fit prices which candidate (`setup_for`), and what the plan says about how far those fits
cover the workload (`coverage_notes`): prompts or batches beyond what the calibration measured,
several workers on one host priced from a server with fewer, a chunk size that was not run.

`threaded_whole`: a colocated whole deployment on a CPU host runs its prompt steps on more threads
than its decode steps (router/workers/threads.py); a calibration from a server that does not
(a probe of a chunked one) carries the measured ratio (benchmarks/prompt_threads.py), and those
candidates get their prompt steps priced that much faster."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from costmodel.plan.candidates import Candidate
from costmodel.plan.score import Scored
from costmodel.sim import compare_predict as cp
from costmodel.workloads import RequestSpec
from engine.config import PROMPT_STEP_TOKENS

# a workload prompt (or a winner's batch) this many times the calibration's gets a note: extrapolated
EXTRAPOLATE = 1.5


def kind_key(c: Candidate) -> str:
    """The calibration kind that prices `c` exactly: its mode, with its workers where several."""
    return f"{c.mode} x{c.decode}" if shared_host(c) else c.mode


def shared_host(c: Candidate) -> bool:
    """Several colocated workers: on one CPU host they contend for its cores and memory."""
    return c.mode in ("colocated", "chunked") and c.decode > 1


@dataclass(frozen=True)
class ThreadedWhole:
    """Colocated whole candidates whose prompt steps run on more threads here than the calibration's."""

    setup: cp.PredictionSetup  # the calibration's, with prompt steps priced `speedup` times faster
    workers: frozenset[int]  # the worker counts whose deployment on this host does so
    speedup: float
    threads: int  # the prompt steps' threads
    prompt_tokens: float  # the prompt length the ratio was read at


def threaded_whole(
    setup: cp.PredictionSetup, host_threads: Mapping[int, tuple[int, int]] | None, prompt_tokens: float
) -> ThreadedWhole | None:
    """`host_threads`: workers -> (decode, prompt) threads of a colocated whole deployment of that
    many workers on this host (benchmarks/prompt_threads.py host_threads). None
    unless the calibration measured the ratio between those two counts and has a step fit."""
    sp, fit = setup.prompt_speedup, setup.steps.fit
    if not sp or not host_threads or fit is None or setup.steps.prompt_fit is not None or not prompt_tokens:
        return None
    if setup.torch_threads not in (None, sp["from_threads"]):  # its steps ran on another count
        return None
    pair = (sp["from_threads"], sp["to_threads"])
    workers = frozenset(w for w, threads in host_threads.items() if threads == pair)
    if not workers:
        return None
    k = speedup_at(sp, prompt_tokens)
    steps = replace(setup.steps, prompt_fit=fit.scaled(1 / k))
    return ThreadedWhole(replace(setup, steps=steps, prompt_threads=pair[1]), workers, k, pair[1], prompt_tokens)


def computed_prompt_tokens(specs: Sequence[RequestSpec]) -> float:
    """The mean prompt a whole-prompt step computes over the workload: a shared prefix counts once
    (its later requests compute the rest), and parts under PROMPT_STEP_TOKENS are left out (such
    steps keep the decode steps' threads). On the shared-prefix chat (256-token prompts, 75% shared)
    reading the ratio at the whole prompt's 249 tokens priced colocated whole's prompt steps at 1/1.56
    of the probe's; they ran 1.72x that (`plan-verify-chat-prefix-probe-n`): the 64 fresh tokens
    gain far less from a second thread."""
    parts = [n for n in computed_parts(specs) if n >= PROMPT_STEP_TOKENS]
    return sum(parts) / len(parts) if parts else 0.0


def computed_parts(specs: Sequence[RequestSpec]) -> list[int]:
    """The prompt tokens each request computes, in arrival order: its prompt, less a shared prefix
    an earlier request computed."""
    seen: set[str] = set()
    parts = []
    for s in sorted(specs, key=lambda r: r.arrival_s):
        cached = s.prefix_len if s.prefix_id is not None and s.prefix_id in seen else 0
        if s.prefix_id is not None:
            seen.add(s.prefix_id)
        parts.append(s.prompt_len - cached)
    return parts


def speedup_at(measured: Mapping[str, Any], prompt_tokens: float) -> float:
    """The measured ratio at `prompt_tokens`: linear in log(tokens) between the lengths measured,
    the nearest one's beyond them (it grows with the prompt: 1.72x at 256 tokens, 1.90x at 2,048
    for SmolLM2 on the 2-core dev VM)."""
    points = sorted((int(n), float(r)) for n, r in measured["speedup_by_prompt_tokens"].items())
    if prompt_tokens <= points[0][0]:
        return points[0][1]
    for (n0, r0), (n1, r1) in zip(points, points[1:]):
        if prompt_tokens <= n1:
            return r0 + math.log(prompt_tokens / n0) / math.log(n1 / n0) * (r1 - r0)
    return points[-1][1]


def setup_for(
    c: Candidate,
    by_kind: Mapping[str, cp.PredictionSetup] | None,
    default: cp.PredictionSetup,
    whole: ThreadedWhole | None = None,
) -> cp.PredictionSetup:
    """The device model that prices `c`: the fit to a server of its kind and worker count (a
    chunked one: run at `c`'s chunk size, else the nearest size run, by ratio, the smaller on a
    tie), else of its kind, else `default` (a `bench compare` result's colocated fit, or a
    calibration file). A chunk size's own fit matters: a fit to 128-token chunks sees every prompt
    step at n = 128, so it cannot tell a chunk's per-token cost from its fixed cost, nor its
    attention pairs from its prefix read; it priced 256-token chunks of 1,024-token prompts 1.5x
    over (docs/plan.md, "Risk, not margin; chunk sizes priced by their own fit"). `whole`: colocated
    whole candidates priced with their prompt steps' threads (`threaded_whole`)."""
    if whole is not None and c.mode == "colocated" and c.chunk is None and c.decode in whole.workers:
        return whole.setup
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
    whole: ThreadedWhole | None = None,
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
    if whole is not None:
        notes.append(
            f"colocated whole ({', '.join(f'x{w}' if w > 1 else '1 worker' for w in sorted(whole.workers))}) runs "
            f"its prompt steps on {whole.threads} threads here: priced {whole.speedup:.2f}x faster than the "
            f"calibration's, the ratio its probe measured for this model's forward at {whole.prompt_tokens:.0f} "
            "tokens (the workload's mean prompt step, a cached prefix left out), timed on a thread as a worker runs "
            "it but without the serving stack's other threads, which take from the borrowed core: where they are "
            "busy (many streams) those figures are optimistic"
        )
    elif not by_kind and "bench probe" in setup.source and not setup.prompt_speedup:
        notes.append(
            "colocated whole is deployed with its prompt steps on the router's spare core too (--prompt-threads "
            "auto), which this probe did not price (it measures the ratio when the server is on this host): its "
            "figures here are pessimistic (on the 2-core VM whole prompts ran at 0.60-0.69x a chunk-256 server's "
            "probed price, plan-verify-rag-probe-m)"
        )
    w = ranked[0].candidate
    if by_kind and w.mode == "chunked" and w.label not in by_kind and (near := nearest_chunk(w, by_kind)):
        notes.append(
            f"the winner's chunk size ({w.chunk}) was not run: priced by {near.source} "
            f"(calibrate it: bench compare --chunk-sizes {w.chunk})"
        )
    return notes
