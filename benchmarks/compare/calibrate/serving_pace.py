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

`plan --verify` reads a candidate's pace the same way (benchmarks/plan_calibration.py `serving_pace`):
it sends the candidate fresh prompts of the lengths the calibration's servers computed whole and alone
(`pace_prompt_lengths`), and matches their steps without their role (a prefill worker's lone prompt is
the model's forward as a colocated one's) and with the lone decode steps after them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from benchmarks.client.logged_step import LoggedStep

# fewer matched steps than this and the ratio is not read (one disturbed step would set it)
MIN_MATCHED = 5


def _key(s: LoggedStep, by_role: bool) -> tuple[str, int, int, int, int, int]:
    sh = s.shape  # the threads too: a colocated server runs its long prompts on two (--prompt-threads)
    role = s.role if by_role else ""
    return (role, s.torch_threads, sh.prefill_tokens, sh.prefill_seqs, sh.decode_seqs, round(sh.attention_pairs))


def _lone(steps: Iterable[LoggedStep], decode: bool) -> Iterable[LoggedStep]:
    """Prompt steps with no decode rows beside them (their time depends on the prompt alone) and,
    with `decode`, steps that decoded one stream alone (its context alone)."""
    for s in steps:
        sh = s.shape
        if s.seconds > 0 and (
            (sh.prefill_tokens > 0 and sh.decode_seqs == 0)
            or (decode and sh.prefill_tokens == 0 and sh.decode_seqs == 1)
        ):
            yield s


def pace_ratio(
    source: Sequence[LoggedStep], here: Sequence[LoggedStep], *, by_role: bool = True, decode: bool = False
) -> tuple[float, int] | None:
    """(median of here / source seconds over lone prompt steps of the same shape, steps matched),
    or None with fewer than MIN_MATCHED matched. Above 1: this server runs slower than the
    source's did. `by_role=False` matches a prefill worker's step to a colocated one's of the same
    shape and threads (one model's forward either way); `decode` reads lone one-stream decode steps too."""
    by_shape: dict[tuple[str, int, int, int, int, int], list[float]] = {}
    for s in _lone(source, decode):
        by_shape.setdefault(_key(s, by_role), []).append(s.seconds)
    ratios = [
        s.seconds / statistics.median(by_shape[k]) for s in _lone(here, decode) if (k := _key(s, by_role)) in by_shape
    ]
    if len(ratios) < MIN_MATCHED:
        return None
    return statistics.median(ratios), len(ratios)


def pace_prompt_lengths(source: Sequence[LoggedStep]) -> list[int]:
    """The lengths of the prompts the source's servers computed whole in one step, alone and with
    nothing cached (attention pairs = tokens squared): sent again as fresh prompts of those lengths,
    one at a time, to a server of any kind, each gives a step the source timed (where that server
    does not chunk it), and its decode steps after it lone decode steps the source timed too."""
    return sorted({
        n for s in _lone(source, decode=False)
        if s.shape.prefill_seqs == 1 and round(s.shape.attention_pairs) == (n := s.shape.prefill_tokens) ** 2
    })  # fmt: skip
