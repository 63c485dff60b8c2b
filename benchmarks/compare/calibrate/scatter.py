"""The decode steps' scatter about their price, from a server's logged warm-up steps.

What a predicted stall is drawn with (costmodel/sim/stall_jitter.py). Read on the decode-side
pool's decode-only steps, grouped by batch size and by whether a prefill ran beside it (a
disaggregated run on shared cores: those steps scatter more), each against its group's typical
price (`same_shape_scatter`): what is left is the steps' own scatter, not the fit's error on a
shape nor the slowdown beside a prefill (both priced apart).
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.client.logged_step import LoggedStep, overlap
from costmodel.fit.step_fit import StepCostFit
from costmodel.sim.stall_jitter import same_shape_scatter

BESIDE_SHARE = 0.5  # a decode step at least this much overlapped by a prefill step ran beside it


def decode_scatter(steps: Sequence[LoggedStep], decode_fit: StepCostFit | None) -> tuple[float, ...]:
    """The scatter (seconds) of the decode pool's (or colocated pool's) decode-only steps (module
    docstring); () without a fit or without MIN_GROUP steps of one shape."""
    if decode_fit is None:
        return ()
    prefill = [s for s in steps if s.role == "prefill"]
    groups: dict[tuple[int, bool], list[tuple[float, float]]] = {}
    for s in steps:
        if s.role not in ("decode", "colocated") or s.shape.prefill_tokens or s.seconds <= 0:
            continue
        share = overlap(s, prefill)
        if 0.0 < share < BESIDE_SHARE:
            continue  # partly beside a prefill: neither group's
        groups.setdefault((s.shape.decode_seqs, share > 0.0), []).append((s.seconds, decode_fit.seconds(s.shape)))
    return same_shape_scatter(groups.values())
