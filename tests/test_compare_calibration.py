"""bench compare's self-calibration: the step log a server reports, fitted per pool; calibration
files that say where they were measured."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks.compare_calibration import LoggedStep, StepLogRecorder, fit_pools, link_rate, trimmed_fit
from costmodel import cost_model as cm
from costmodel.compare_predict import predict, setup_from_steps, sim_config
from costmodel.machine import calibration_mismatch, cpu_model, git
from costmodel.provenance import save_calibration
from costmodel.serve_metrics import RequestRecord
from costmodel.step_fit import StepCostFit, StepShape
from costmodel.workloads import RequestSpec

TRUE = StepCostFit(fixed_s=0.030, per_token_s=0.0004, attention_s=2e-9, per_sequence_s=0.004)


def _steps(n: int, rng: random.Random) -> list[tuple[StepShape, float]]:
    """Decode steps of 1-8 streams, some with a prompt chunk, priced by TRUE with 3% noise."""
    out = []
    for _ in range(n):
        ctxs = [rng.randint(64, 600) for _ in range(rng.randint(1, 8))]
        chunks = [(rng.choice((0, 128, 256)), rng.choice((64, 128, 512)))] if rng.random() < 0.3 else []
        shape = StepShape.of(ctxs, chunks)
        out.append((shape, TRUE.seconds(shape) * rng.uniform(0.97, 1.03)))
    return out


def test_trimmed_fit_drops_cold_steps_and_recovers_the_step_prices():
    rng = random.Random(0)
    samples = _steps(120, rng)
    # the first step of a few shapes ran cold: 5x its price
    for i in (0, 7, 19):
        samples[i] = (samples[i][0], samples[i][1] * 5)
    f, trimmed = trimmed_fit(samples)
    assert trimmed >= 3
    for shape in (StepShape.of([300] * 8), StepShape.of([100]), StepShape.of([200] * 4, [(0, 512)])):
        assert f.seconds(shape) == pytest.approx(TRUE.seconds(shape), rel=0.05)


def test_fit_pools_fits_each_role_apart():
    rng = random.Random(1)
    slow_prefill = StepCostFit(0.05, 0.001, 4e-9, 0.0)
    steps = [LoggedStep("decode-0", "decode", s, y) for s, y in _steps(40, rng) if s.prefill_tokens == 0]
    for n in (64, 128, 256, 512, 1024) * 3:
        shape = StepShape.of((), [(0, n)])
        steps.append(LoggedStep("prefill-0", "prefill", shape, slow_prefill.seconds(shape)))
    pools = fit_pools(steps)
    assert set(pools) == {"prefill", "decode"}
    p = StepShape.of((), [(0, 700)])
    assert pools["prefill"].fit.seconds(p) == pytest.approx(slow_prefill.seconds(p), rel=0.02)
    assert pools["decode"].fit.decode_seconds([300] * 6) == pytest.approx(TRUE.decode_seconds([300] * 6), rel=0.05)
    assert fit_pools(steps[:3]) == {}  # too few steps: no fit is trusted


def test_recorder_keeps_each_step_once():
    rec = StepLogRecorder("http://127.0.0.1:1")
    row = {"step": 5, "prefill_tokens": 0, "attention_pairs": 100.0, "decode_seqs": 2, "seconds": 0.1}
    later = dict(row, step=6, seconds=0.2)
    rec.add([{"worker": "w0", "role": "colocated", "steps": [row]}])
    rec.add([{"worker": "w0", "role": "colocated", "steps": [row, later]}])
    rec.add([{"worker": "w1", "role": "colocated", "steps": [row]}])
    assert sorted((s.worker, s.seconds) for s in rec.steps) == [("w0", 0.1), ("w0", 0.2), ("w1", 0.1)]


def test_link_rate_prices_the_models_kv_bytes():
    per_token = 1000
    recs = [
        RequestRecord("d0", "document", 512, 4, 0.0, prompt_tokens=500, transfer={"ms": 5.0}),
        RequestRecord("d1", "document", 512, 4, 0.0, prompt_tokens=500, transfer={"ms": 10.0}),
        RequestRecord("d2", "document", 512, 4, 0.0, prompt_tokens=500, transfer={"ms": 15.0}),
        RequestRecord("c0", "chat", 64, 4, 0.0),
    ]
    assert link_rate(recs, per_token) == pytest.approx(500 * 1000 / 0.010 / 1e9)
    assert link_rate(recs[3:], per_token) is None


def test_a_self_calibrated_disagg_prediction_prices_prefill_with_the_prefill_pools_fit():
    slow_prefill = StepCostFit(0.0, 0.002, 0.0, 0.0)  # 2 ms/token
    setup = setup_from_steps("tiny", TRUE, slow_prefill, 5.0, "test", 100)
    doc = RequestSpec("doc-0", "x", 500, 2, 0.0, "document")
    p = predict("disagg", sim_config("disagg", None, 1, 1, 64, setup.link), setup, [doc], None, None)
    assert p.records[0].ttft_s == pytest.approx(1.0)  # 500 tokens x 2 ms, not TRUE's price
    assert setup.describe()["kind"] == "self"


def test_calibration_files_carry_provenance_and_warn_when_foreign(tmp_path):
    path = save_calibration(cm.Calibration(device="cpu", peak_tflops=1.0), tmp_path / "c.calibration.json")
    cal = cm.Calibration.load(path)
    assert cal.provenance["cpu"] == cpu_model() and cal.provenance["cores"] >= 1
    assert "date_utc" in cal.provenance and "load_average" in cal.provenance
    assert cal.origin_warning(path) is None  # measured here, at this commit

    foreign = dict(cal.provenance, cpu="Some Other CPU 9000")
    warning = calibration_mismatch("c.json", foreign)
    assert warning and "Some Other CPU 9000" in warning and "\n" not in warning
    if git("rev-parse", "HEAD"):
        assert "commit 0000000000" in calibration_mismatch("c.json", dict(cal.provenance, git_commit="0" * 40))

    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"schema": cm.Calibration.SCHEMA, "peak_tflops": 1.0}))
    assert "no provenance" in cm.Calibration.load(bare).origin_warning(bare)
