"""What a verified candidate's workers' steps cost against the prices the plan gave them
(`step_prices`, per pool and by prompt length), and the time a worker spends between two steps
(`loop_gaps`), which no step's own time holds: a step model that was off told from a scheduling
model that was. benchmarks/plan_verify.py records them in each row (benchmarks/verify_rows.py).
`step_pace`: the same ratio read before a candidate's timed pass, its prediction re-priced by it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.client.logged_step import LoggedStep
from costmodel.sim.compare_predict import PredictionSetup


def step_prices(steps: list[LoggedStep], setup: PredictionSetup) -> dict[str, Any] | None:
    """Per pool: how many steps ran, and what they cost against the plan's price for their shape
    (p50 and p90 of measured / priced, and summed time over summed price), with the most
    sequences a step decoded; the same for the steps that carried prompt tokens alone (a pool's
    p50 is mostly decode steps, a TTFT mostly prompt steps). Tells a step model that was off from
    a scheduling model that was (None: a datasheet model prices no shape)."""
    by_pool: dict[str, list[tuple[float, float, int, bool]]] = {}
    by_length: dict[str, dict[tuple[int, int], list[tuple[float, float, int, bool]]]] = {}
    for s in steps:
        f = setup.steps.fit_of(s.role, s.shape.prefill_tokens)
        if f is None:
            return None
        priced = f.seconds(s.shape)
        if priced > 0 and s.seconds > 0:
            row = (s.seconds, priced, s.shape.decode_seqs, s.shape.prefill_tokens > 0)
            by_pool.setdefault(s.role, []).append(row)
            if s.shape.prefill_tokens > 0:
                key = (_bucket(s.shape.prefill_tokens), s.torch_threads)
                by_length.setdefault(s.role, {}).setdefault(key, []).append(row)
    out = {}
    for pool, xs in by_pool.items():
        prompt = [x for x in xs if x[3]]
        out[pool] = {**_prices(xs), "largest_batch": max(b for *_, b, _ in xs)}
        if prompt and len(prompt) < len(xs):
            out[pool]["prompt_steps"] = _prices(prompt)
            # by prompt tokens and threads: what a step's length and its thread count did to its price
            out[pool]["prompt_steps_by_tokens"] = [
                {"tokens": f"{lo}-{2 * lo - 1}" if lo else "1-63", "threads": threads, **_prices(rows)}
                for (lo, threads), rows in sorted(by_length[pool].items())
            ]
        gaps = loop_gaps([s for s in steps if s.role == pool])
        if gaps:
            out[pool]["loop_gap"] = gaps
    return out


# fewer steps of a kind than these and its pace is not read (one disturbed step would set it)
MIN_PROMPT_STEPS = 3
MIN_DECODE_STEPS = 5


@dataclass(frozen=True)
class StepPace:
    """A server's steps against the plan's prices for their shapes (summed time over summed price),
    apart for the steps that computed prompt tokens (`step_pace`: which) and those that decoded two
    streams or more alone; None where too few ran. The plan re-prices a step by its kind whole
    (StepModel.decode_pace)."""

    prompt: float | None
    prompt_steps: int
    decode: float | None
    decode_steps: int

    def paces(self) -> tuple[float, float]:
        """(prompt, decode) paces, the one read standing in for the other where it was not."""
        kp, kd = self.prompt or self.decode, self.decode or self.prompt
        assert kp is not None and kd is not None  # step_pace returns none without either
        return kp, kd

    def describe(self) -> str:
        prompt = f"{self.prompt:.2f}x (prompt, {self.prompt_steps} steps)" if self.prompt else ""
        decode = f"{self.decode:.2f}x (decode, {self.decode_steps})" if self.decode else ""
        return ", ".join(x for x in (prompt, decode) if x)

    def to_dict(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "prompt_steps": self.prompt_steps, "decode": self.decode,
                "decode_steps": self.decode_steps}  # fmt: skip


def step_pace(steps: list[LoggedStep], setup: PredictionSetup) -> StepPace | None:
    """What `steps` cost against `setup`'s prices (None: a datasheet model, or too few steps of either
    kind): the steps that computed prompt tokens beside a decoding batch, as a loaded server's do
    (those alone too where fewer than MIN_PROMPT_STEPS ran so: a prompt-only step read 1.16-1.39x
    its price where the same lengths beside decoding read 1.03-1.09x, 2026-12-06), and the steps
    that decoded two streams or more alone. A decode step that ran while another worker computed a
    prompt is left out: on a CPU host the two share cores (the plan prices that apart,
    SimConfig.decode_slowdown)."""
    prompt_at = [(s.end_unix_s - s.seconds, s.end_unix_s, s.worker) for s in steps if s.shape.prefill_tokens]
    alone: list[tuple[float, float]] = []
    beside: list[tuple[float, float]] = []
    decode: list[tuple[float, float]] = []
    for s in steps:
        f = setup.steps.fit_of(s.role, s.shape.prefill_tokens)
        if f is None:
            return None
        sh, priced = s.shape, f.seconds(s.shape)
        if priced <= 0 or s.seconds <= 0:
            continue
        if sh.prefill_tokens:
            (beside if sh.decode_seqs else alone).append((s.seconds, priced))
        elif sh.decode_seqs >= 2:
            start = s.end_unix_s - s.seconds
            if not any(w != s.worker and a < s.end_unix_s and start < b for a, b, w in prompt_at):
                decode.append((s.seconds, priced))
    prompt = beside if len(beside) >= MIN_PROMPT_STEPS else alone + beside
    ratio = lambda xs, least: sum(m for m, _ in xs) / sum(p for _, p in xs) if len(xs) >= least else None  # noqa: E731
    found = StepPace(ratio(prompt, MIN_PROMPT_STEPS), len(prompt), ratio(decode, MIN_DECODE_STEPS), len(decode))
    return found if found.prompt is not None or found.decode is not None else None


GAP_BATCHES = ((1, 4), (5, 12), (13, 10**6))
IDLE_GAP_S = 0.010


def loop_gaps(steps: list[LoggedStep]) -> dict[str, Any] | None:
    """The time a worker spends between two steps while it has work (the loop: events out, calls
    in, the GIL shared with its Ray threads), which no step's `seconds` holds and the simulator
    does not price. A gap counts when both steps decoded and it is shorter than the step after it
    (and 10 ms): a longer one is an idle spell between batches that happen to both decode (a
    disaggregated decode worker between one document's tokens and the next's)."""
    by_worker: dict[str, list[LoggedStep]] = {}
    for s in steps:
        if s.end_unix_s > 0:
            by_worker.setdefault(s.worker, []).append(s)
    pairs: list[tuple[float, float, int]] = []  # (gap s, step s, batch)
    for xs in by_worker.values():
        xs.sort(key=lambda s: s.end_unix_s)
        for a, b in zip(xs, xs[1:], strict=False):
            gap = max(0.0, b.end_unix_s - b.seconds - a.end_unix_s)
            if a.shape.decode_seqs and b.shape.decode_seqs and gap < max(b.seconds, IDLE_GAP_S):
                pairs.append((gap, b.seconds, b.shape.decode_seqs))
    if not pairs:
        return None
    gaps = sorted(g for g, *_ in pairs)
    by_batch = {}
    for lo, hi in GAP_BATCHES:
        inside = sorted(g for g, _, n in pairs if lo <= n <= hi)
        if inside:
            by_batch[f"{lo}-{hi}" if hi < 10**6 else f"{lo}+"] = round(inside[len(inside) // 2] * 1e3, 2)
    return {
        "busy_gaps": len(gaps),
        "gap_ms_p50": gaps[len(gaps) // 2] * 1e3,
        "gap_ms_p90": gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))] * 1e3,
        "gap_share": sum(gaps) / sum(s for _, s, _ in pairs),  # of the busy steps' own time
        "gap_ms_p50_by_batch": by_batch,
    }


def _bucket(prompt_tokens: int) -> int:
    """A step's prompt length as the power of two at or below it (from 64; 0 below 64)."""
    return 0 if prompt_tokens < 64 else 1 << (prompt_tokens.bit_length() - 1)


def _prices(xs: list[tuple[float, float, int, bool]]) -> dict[str, Any]:
    ratios = sorted(m / p for m, p, *_ in xs)
    return {
        "steps": len(xs),
        "ratio_p50": ratios[len(ratios) // 2],
        "ratio_p90": ratios[min(len(ratios) - 1, int(0.9 * len(ratios)))],
        "time_ratio": sum(m for m, *_ in xs) / sum(p for _, p, *_ in xs),
    }
