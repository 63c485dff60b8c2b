"""How fast a server runs now against the server a transferred fit was measured on, read from
the same requests timed on both.

A `--transfer-from` prediction prices this run's steps with an earlier run's fit, and on the
shared 2-core VMs the machine's pace moves between runs: the chunked-128 server of one demo run
decoded a lone stream in 22.4 ms a step, the same server eight minutes later in 15.9, and every
figure of the transfer was then 20-39% long (`transfer-schedule-b-zb`, 2026-12-06). The one-thread
GEMM probe taken before each server (benchmarks/pace.py) does not track serving: in `plan --verify`
it brought 7 of 20 predictions closer and 9 further off (docs/plan.md).

Every `bench compare` warm-up ends with the same side prompts (side_requests.py: excerpts of one
text, sent alone, whatever the workload), so a source run's server and this run's computed
identical prompt steps. Their ratio, median over the steps matched by exact shape, is this
server's pace against the fit's: the prediction is re-priced at it beside the plain transfer
(nothing of this run's workload enters; the side prompts are the same in every run).

`plan --verify` reads a candidate's pace against the plan's own prices instead (benchmarks/
verify_steps.py `step_pace`): it sends requests of the workload's shapes, which no calibration timed.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from benchmarks.client.logged_step import LoggedStep

# fewer matched steps than this and the ratio is not read (one disturbed step would set it)
MIN_MATCHED = 5


def _key(s: LoggedStep) -> tuple[str, int, int, int, int]:
    sh = s.shape  # the threads too: a colocated server runs its long prompts on two (--prompt-threads)
    return (s.role, s.torch_threads, sh.prefill_tokens, sh.prefill_seqs, round(sh.attention_pairs))


def _lone_prompts(steps: Iterable[LoggedStep]) -> Iterable[LoggedStep]:
    """Prompt steps with no decode rows beside them: their time depends on the prompt alone."""
    return (s for s in steps if s.shape.prefill_tokens > 0 and s.shape.decode_seqs == 0 and s.seconds > 0)


def pace_ratio(source: Sequence[LoggedStep], here: Sequence[LoggedStep]) -> tuple[float, int] | None:
    """(median of here / source seconds over lone prompt steps of the same shape, steps matched),
    or None with fewer than MIN_MATCHED matched. Above 1: this server runs slower than the
    source's did."""
    by_shape: dict[tuple[str, int, int, int, int], list[float]] = {}
    for s in _lone_prompts(source):
        by_shape.setdefault(_key(s), []).append(s.seconds)
    ratios = [s.seconds / statistics.median(by_shape[k]) for s in _lone_prompts(here) if (k := _key(s)) in by_shape]
    if len(ratios) < MIN_MATCHED:
        return None
    return statistics.median(ratios), len(ratios)
