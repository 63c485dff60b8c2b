"""A predicted stall drawn with the steps' measured scatter (costmodel/sim/stall_jitter.py), where
the scatter comes from (a self-calibration's logged steps, a probe's calibration file), and that
the simulator's predictions carry it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from benchmarks.client.logged_step import LoggedStep
from benchmarks.compare.calibrate.scatter import decode_scatter
from costmodel.fit.calibration import Calibration
from costmodel.fit.step_fit import StepCostFit, StepShape
from costmodel.serve_metrics import RequestRecord, compute_metrics
from costmodel.sim import compare_predict as cp
from costmodel.sim.stall_jitter import (
    MAX_SAMPLES,
    jittered_stall,
    same_shape_scatter,
    thinned,
    window_steps,
    with_scatter,
)
from costmodel.workloads import RequestSpec


def _record(rid: str, kind: str, send: float, times: list[float]) -> RequestRecord:
    return RequestRecord(rid, kind, 64, len(times), send, send_s=send, chunk_times_s=times, end_s=times[-1])


def _mix() -> list[RequestRecord]:
    """Two streams stepping together every 50 ms (one step of 80 ms) and a document sent at 1.02 s
    whose first token comes at 1.30 s: six of their steps overlap its wait."""
    steps = [round(0.05 * i, 2) for i in range(1, 31)]
    steps = [t if t <= 1.15 else round(t + 0.03, 2) for t in steps]
    return [
        _record("chat-0", "chat", 0.0, steps),
        _record("chat-1", "chat", 0.0, steps),
        _record("doc-0", "document", 1.02, [1.30, 1.35]),
    ]


def test_scatter_is_each_step_against_its_group_typical_price():
    # a group the fit prices 20% low throughout: that is the fit's error, not scatter
    group = [(0.12, 0.1), (0.12, 0.1), (0.12, 0.1)]
    assert same_shape_scatter([group]) == (0.0, 0.0, 0.0)
    spread = [(0.09, 0.1), (0.10, 0.1), (0.12, 0.1)]
    assert same_shape_scatter([spread]) == pytest.approx((-0.01, 0.0, 0.02))
    assert same_shape_scatter([[(0.2, 0.1), (0.1, 0.1)]]) == ()  # too few steps of that kind to tell
    assert len(thinned([0.001 * i for i in range(5 * MAX_SAMPLES)])) == MAX_SAMPLES


def test_a_window_of_like_steps_stalls_longer_than_its_longest_price():
    steps = [0.05] * 20
    assert jittered_stall(steps, (0.0,), seed=0) == pytest.approx(0.05)
    scatter = (-0.005, 0.0, 0.005, 0.02)
    drawn = jittered_stall(steps, scatter, seed=0)
    assert drawn == pytest.approx(0.07)  # the longest of twenty draws: nearly always a +20 ms one
    assert jittered_stall(steps, scatter, seed=0) == drawn  # seeded
    # one long step: the scatter barely moves it (added, not scaled)
    assert 0.8 <= jittered_stall([0.05, 0.8], scatter, seed=0) <= 0.8 + 0.02


def test_a_documents_window_is_the_streams_shared_steps_and_its_stall_is_drawn_on_them():
    recs = _mix()
    assert sorted(round(x, 3) for x in window_steps(recs[-1], recs)) == [0.05] * 5 + [0.08]
    plain = compute_metrics(recs)
    assert plain.stall_ms.max == pytest.approx(80.0)
    assert with_scatter(plain, recs, ()) is plain  # no scatter measured: as it is
    assert with_scatter(plain, recs, (0.0,)).stall_ms.max == pytest.approx(80.0)
    drawn = with_scatter(plain, recs, (0.03,))  # every step 30 ms over its price
    assert drawn.stall_ms.max == pytest.approx(110.0)
    assert drawn.documents[0].stall_s == pytest.approx(0.11)
    assert drawn.ttft_ms == plain.ttft_ms  # only the stall is drawn


def test_the_simulators_prediction_carries_the_scatter():
    fit = StepCostFit(fixed_s=0.02, per_token_s=0.0005, attention_s=0.0, per_sequence_s=0.001)
    setup = cp.setup_from_steps("tiny", fit, None, None, "test fit", 10)
    specs = [RequestSpec(f"chat-{i}", "", 64, 40, 0.0, "chat") for i in range(2)]
    specs.append(RequestSpec("doc-0", "", 512, 2, 0.3, "document"))
    cfg = cp.sim_config("colocated", 128, 1, 1, 64, setup.link)
    plain = cp.predict("chunked", cfg, setup, specs, None, None).metrics.stall_ms.max
    drawn = cp.predict("chunked", cfg, replace(setup, step_scatter_s=(0.02,)), specs, None, None)
    assert plain and drawn.metrics.stall_ms.max == pytest.approx(plain + 20.0)
    assert replace(setup, step_scatter_s=(0.02,)).describe()["step_scatter_ms"]["p50"] == 20.0


def _step(role: str, seqs: int, seconds: float, end: float, prompt: int = 0) -> LoggedStep:
    chunks = [(0, prompt)] if prompt else []
    return LoggedStep("w", role, StepShape.of([32] * seqs, chunks), seconds, end)


def test_a_self_calibrations_scatter_groups_steps_by_batch_and_by_a_prefill_beside():
    fit = StepCostFit(fixed_s=0.04, per_token_s=0.0, attention_s=0.0, per_sequence_s=0.0)  # 40 ms a step
    colocated = [_step("colocated", 2, s, 10.0 + i) for i, s in enumerate((0.050, 0.052, 0.048))]
    colocated.append(_step("colocated", 2, 0.9, 20.0, prompt=256))  # a prompt step: not a decode step
    assert sorted(decode_scatter(colocated, fit)) == pytest.approx([-0.002, 0.0, 0.002])
    assert decode_scatter(colocated, None) == ()
    # disaggregated on shared cores: steps beside a prefill scatter about their own typical price
    prefill = _step("prefill", 0, 0.5, 30.5, prompt=512)  # ran 30.0-30.5
    beside = [_step("decode", 2, s, 30.1 + 0.1 * i) for i, s in enumerate((0.08, 0.09, 0.07))]
    lone = [_step("decode", 2, 0.05, 40.0 + i) for i in range(3)]
    partly = _step("decode", 2, 0.2, 30.6)  # 30.4-30.6: half of it beside, half not: neither group
    got = sorted(decode_scatter([prefill, *beside, *lone, partly], fit))
    assert got == pytest.approx([-0.01, 0.0, 0.0, 0.0, 0.0, 0.01])


def test_a_calibration_files_scatter_is_read_in_ms_and_checked(tmp_path):
    fit = StepCostFit(fixed_s=0.02, per_token_s=0.0005, attention_s=0.0, per_sequence_s=0.001)
    cal = Calibration(device="cpu", dtype="fp32", step_fit=fit.to_dict(), step_scatter_ms=[1.0, -2.0])
    path = tmp_path / "c.calibration.json"
    path.write_text(json.dumps(cal.to_dict()))
    assert cp.setup_from_calibration("tiny", path).step_scatter_s == pytest.approx((0.001, -0.002))
    with pytest.raises(ValueError, match="step_scatter_ms"):
        Calibration.from_dict({**cal.to_dict(), "step_scatter_ms": ["x"]})
