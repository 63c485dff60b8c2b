"""One engine step as a server's step log reported it (`GET /v1/workers/steps`), and the row a
`bench compare` result keeps it as, so a later step model can refit a calibration's own steps
(`calibration.SelfCalibration.refitted`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from costmodel.fit.step_fit import StepShape


@dataclass(frozen=True)
class LoggedStep:
    worker: str
    role: str  # "colocated" | "prefill" | "decode"
    shape: StepShape
    seconds: float
    end_unix_s: float = 0.0  # the worker's wall clock: steps of one host line up across pools
    torch_threads: int = 0  # intra-op threads the step ran with (0: the server did not say)

    def to_row(self) -> list[Any]:
        """One row of `STEP_COLUMNS`: a result keeps the steps it was fitted on, to refit later."""
        sh = self.shape
        return [
            self.worker,
            self.role,
            sh.prefill_tokens,
            sh.attention_pairs,
            sh.decode_seqs,
            sh.decode_pairs,
            round(self.seconds, 7),
            round(self.end_unix_s, 6),
            self.torch_threads,
            sh.prefill_seqs,
            sh.prefill_reads,
        ]

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> LoggedStep:
        worker, role, toks, pairs, seqs, dpairs, seconds, end, threads, *items = row  # items: not in early rows
        shape = StepShape.reported(int(toks), float(pairs), int(seqs), float(dpairs), *items)
        return cls(str(worker), str(role), shape, float(seconds), float(end), int(threads))


STEP_COLUMNS = (
    "worker",
    "role",
    "prefill_tokens",
    "attention_pairs",
    "decode_seqs",
    "decode_pairs",
    "seconds",
    "end_unix_s",
    "torch_threads",
    "prefill_seqs",
    "prefill_reads",
)


def steps_table(steps: Iterable[LoggedStep]) -> dict[str, Any]:
    """Steps as a result file keeps them: the column names once, a row each (`from_table` reads it)."""
    return {"columns": list(STEP_COLUMNS), "rows": [s.to_row() for s in steps]}


def from_table(table: dict[str, Any] | None) -> list[LoggedStep]:
    """The steps of a `steps_table` (none for None or a table without rows)."""
    return [LoggedStep.from_row(r) for r in (table or {}).get("rows") or []]


def overlap(step: LoggedStep, others: Sequence[LoggedStep]) -> float:
    """The share of `step` during which any of `others` ran (on the workers' wall clocks)."""
    start, end = step.end_unix_s - step.seconds, step.end_unix_s
    spans = sorted((max(start, o.end_unix_s - o.seconds), min(end, o.end_unix_s)) for o in others)
    covered, reach = 0.0, start
    for a, b in spans:
        if b > max(a, reach):
            covered += b - max(a, reach)
            reach = b
    return covered / step.seconds if step.seconds > 0 else 0.0
