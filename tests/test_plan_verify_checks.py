"""What `pdserve plan` and `--verify` check about the measurement itself: a calibration measured on
another CPU than this machine's (benchmarks/plan_verify.py `_calibrated_elsewhere`), and the time a
worker spends between steps, which no step's own time holds (benchmarks/verify_steps.py `loop_gaps`)."""

from __future__ import annotations

import json

import pytest

from cli import main as cli_main
from costmodel.fit.step_fit import StepCostFit, StepShape

FIT = StepCostFit(0.005, 1e-3, 0.0, 1e-3, samples=100, rms_rel_error=0.1)


def _compare_result(tmp_path, cpu: str) -> str:
    from benchmarks.compare.calibrate.calibration import PoolFit, SelfCalibration

    cal = SelfCalibration({"colocated": PoolFit("colocated", FIT, 100, 0, 1)}, 10.0, 4, None, longest_prompt=256)
    mode = {"label": "colocated", "spec": {"mode": "colocated", "chunk_size": None, "decode": 1}}
    mode |= {"self_calibration": cal.to_dict(), "serving_overhead": {"hop_ms": 10.0}}
    prov = {"config": {"bench_command": "compare", "model": "tiny"}, "machine": {"cpu": cpu}}
    path = tmp_path / f"compare-{len(cpu)}.json"
    path.write_text(json.dumps({"provenance": prov, "modes": [mode]}))
    return str(path)


def test_a_calibration_measured_on_another_cpu_is_named_in_the_plan(tmp_path, capsys):
    """Machines of one cloud kind differ (the dev VM came back an AMD EPYC whose steps ran 0.53-0.57x
    the prices fitted on an Intel Xeon): the plan says its figures predict the other machine."""
    from costmodel.machine import cpu_model

    args = ("--model", "tiny", "--workers", "1", "--workload", "chat", "--num-requests", "8", "--isl", "256", "--json")
    assert cli_main(["plan", "--calibration", _compare_result(tmp_path, "Some Other CPU @ 1 GHz"), *args]) == 0
    note = json.loads(capsys.readouterr().out)["workload"]["note"]
    assert "measured on 'Some Other CPU @ 1 GHz'" in note and repr(cpu_model()) in note
    assert "calibrate here" in note
    assert cli_main(["plan", "--calibration", _compare_result(tmp_path, cpu_model()), *args]) == 0
    assert "measured on" not in (json.loads(capsys.readouterr().out)["workload"]["note"] or "")


def test_loop_gaps_read_the_time_between_steps_while_sequences_wait():
    """A gap counts only between two steps that both decoded (work waited throughout): the time
    before a step that follows an idle spell, or one of prompt tokens alone, is not the loop's."""
    from benchmarks.client.logged_step import LoggedStep
    from benchmarks.verify_steps import loop_gaps

    def step(worker: str, batch: int, end: float, seconds: float = 0.010) -> LoggedStep:
        shape = StepShape.of([100] * batch) if batch else StepShape.of((), [(0, 64)])
        return LoggedStep(worker, "decode", shape, seconds, end_unix_s=end)

    # worker a: 10 ms steps 1 ms apart; a step of prompt tokens alone; then 3 ms apart at batch 16
    a = [step("a", 2, 1.010), step("a", 2, 1.021), step("a", 3, 1.032), step("a", 0, 2.032)]
    a += [step("a", 16, 2.045), step("a", 16, 2.058)]
    b = [step("b", 0, 5.0), step("b", 6, 5.012), step("b", 6, 5.024)]  # a prompt step, then 2 ms apart
    got = loop_gaps(a + b)
    assert got is not None
    assert got["busy_gaps"] == 4  # a: 1-2, 2-3, 5-6; b: 2-3 (none across the prompt-only steps)
    assert got["gap_ms_p50_by_batch"]["1-4"] == pytest.approx(1.0, abs=0.01)
    assert got["gap_ms_p50_by_batch"]["5-12"] == pytest.approx(2.0, abs=0.01)
    assert got["gap_ms_p50_by_batch"]["13+"] == pytest.approx(3.0, abs=0.01)
    assert loop_gaps([step("c", 0, 1.0), step("c", 0, 2.0)]) is None  # no decoding: no busy gap
    idle = loop_gaps([step("d", 1, 1.0), step("d", 1, 3.0)])  # 2 s between two batches: an idle spell
    assert idle is None


def test_a_winner_that_breaks_its_stall_slo_reads_its_regret_both_ways():
    """Goodput counts requests within TTFT and TPOT, not the stall: the mixed workload's winner
    (2026-12-05 19:50, stall attainment 25%) measured the most goodput and 0% regret by it; valued
    as the plan's risk values a stall miss (nothing), the regret is 100%."""
    from benchmarks.verify_rows import VerifyRow, format_verification, summarize
    from costmodel.plan.candidates import Candidate
    from costmodel.plan.score import Judged

    stalls = VerifyRow(Candidate("chunked", 2, chunk=64), 1, Judged({}, True, 0.29), Judged({}, False, 0.21), {})
    stalls.metrics = {"stall_p90_ms": 400.0}
    holds = VerifyRow(Candidate("disagg", 1, 1), 2, Judged({}, True, 0.19), Judged({}, True, 0.18), {})
    holds.metrics = {"stall_p90_ms": 70.0}
    summary = summarize([stalls, holds], stalls.candidate.label, stall_slo_ms=275.0)
    assert summary["regret"] == 0.0 and summary["regret_stall_worth_nothing"] == pytest.approx(1.0)
    assert "with a stall SLO missed worth nothing: regret 100.0%" in format_verification([stalls, holds], summary)
    fine = summarize([stalls, holds], holds.candidate.label, stall_slo_ms=275.0)
    assert fine["regret_stall_worth_nothing"] == 0.0 and fine["regret"] == pytest.approx(1 - 0.18 / 0.21)
    assert summarize([stalls, holds], stalls.candidate.label)["regret_stall_worth_nothing"] is None  # no stall SLO


def test_the_errors_of_candidates_away_from_an_slos_edge_are_read_apart():
    """A candidate the plan gave a 20-90% chance of missing an SLO sits on its edge, where two
    measurements of one deployment differ as much as a prediction may: the summary reads the worst
    errors of the others apart (docs/plan.md, "Accuracy by the plan's own miss risk")."""
    from benchmarks.verify_rows import VerifyRow, format_verification, summarize
    from costmodel.plan.candidates import Candidate
    from costmodel.plan.score import Judged

    def row(chunk: int, risk: float | None, predicted: float, measured: float, att: tuple[float, float]) -> VerifyRow:
        p, m = Judged({"tpot": att[0]}, True, predicted), Judged({"tpot": att[1]}, True, measured)
        return VerifyRow(Candidate("chunked", 1, chunk=chunk), 1, p, m, {}, miss_risk=risk)

    safe = row(64, 0.05, 1.05, 1.00, (1.0, 1.0))
    certain = row(128, 0.99, 0.50, 0.52, (0.5, 0.48))
    edge = row(256, 0.45, 2.0, 1.0, (0.9, 0.6))  # off by 100% and 30 points
    unweighed = row(512, None, 3.0, 1.0, (1.0, 0.5))  # the baseline: not in either count
    summary = summarize([safe, certain, edge, unweighed], "chunked 64")
    away = summary["away_from_edge"]
    assert away["rows"] == 2 and away["on_edge_rows"] == 1
    assert away["goodput_error_max"] == pytest.approx(0.05) and away["attainment_error_max_pts"] == pytest.approx(2.0)
    assert summary["goodput_error_max"] == pytest.approx(2.0)  # every row's, as before
    text = format_verification([safe, certain, edge, unweighed], summary)
    assert "2 candidates: goodput within 5%, attainment within 2 points (1 on an edge)" in text
    assert safe.to_dict()["plan_miss_risk"] == 0.05


def test_the_summary_counts_the_measured_goodputs_inside_the_plans_interval():
    """The plan prints each candidate's goodput with every step priced its fit's error lower and
    higher; the verification says how often the measured goodput landed inside that interval."""
    from benchmarks.verify_rows import VerifyRow, format_verification, summarize
    from costmodel.plan.candidates import Candidate
    from costmodel.plan.score import Judged

    def row(chunk: int, measured: float, interval: tuple[float, float] | None) -> VerifyRow:
        c = Candidate("chunked", 1, chunk=chunk)
        return VerifyRow(c, 1, Judged({}, True, 1.0), Judged({}, True, measured), {}, goodput_interval=interval)

    rows = [row(64, 1.1, (0.9, 1.2)), row(128, 1.3, (0.9, 1.2)), row(256, 5.0, None)]
    summary = summarize(rows, "chunked 64")
    assert summary["goodput_inside_interval"] == {"inside": 1, "rows": 2}  # no interval: not counted
    assert "measured goodput inside the plan's interval: 1 of 2" in format_verification(rows, summary)
    assert rows[0].to_dict()["plan_goodput_interval"] == [0.9, 1.2]


def test_the_prediction_repriced_at_the_timed_pass_own_steps_is_said_not_to_be_one():
    """After the timed pass the plan's prediction is made again at what its steps cost against the
    plan's prices (prompt and decode apart): what is left of the error is the schedule's. The
    verification prints it as after the fact, with its worst error, and keeps both in the JSON."""
    from benchmarks.verify_rows import VerifyRow, format_verification, summarize
    from benchmarks.verify_steps import StepPace
    from costmodel.plan.candidates import Candidate
    from costmodel.plan.score import Judged

    def row(chunk: int, measured: float, at_run: float) -> VerifyRow:
        r = VerifyRow(Candidate("chunked", 1, chunk=chunk), 1, Judged({}, True, 1.5), Judged({}, True, measured), {})
        r.run_pace, r.run_paced = StepPace(1.1, 4, 1.3, 30), Judged({}, True, at_run)
        return r

    rows = [row(64, 1.0, 1.05), row(128, 2.0, 1.8)]
    summary = summarize(rows, "chunked 64")
    assert summary["goodput_error_max_at_run_pace"] == pytest.approx(0.10)
    text = format_verification(rows, summary)
    assert "after the fact" in text and "not a prediction" in text
    assert "chunked 64 1.050/s (1.10x/1.30x)" in text and "goodput within 10% of measured" in text
    d = rows[0].to_dict()
    assert d["run_pace"] == {"prompt": 1.1, "prompt_steps": 4, "decode": 1.3, "decode_steps": 30}
    assert d["predicted_at_run_pace"]["goodput_per_worker"] == 1.05
    assert StepPace(None, 1, 0.9, 8).paces() == (0.9, 0.9)  # the one read stands in for the other
